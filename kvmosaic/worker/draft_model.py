"""Loading a draft model for speculation: the target's own weights requantized (``self``) or a
model file with the target's tokenizer (``draft``). What runs it each step: ``kvmosaic.worker.drafter``."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from kvmosaic.config_spec import SpeculativeConfig, SpeculativeConfigError
from kvmosaic.model.loader import LoadedModel, is_matrix, load_model
from kvmosaic.quant import weights as qw

logger = logging.getLogger(__name__)
SLOW_DRAFT_SHARE = 0.6  # a draft reading more than this share of the target's matrix bytes cannot pay


def load_draft(spec: SpeculativeConfig | None, target: LoadedModel, dtype: torch.dtype) -> LoadedModel | None:
    """The draft model a config asks for (None: speculation without one): ``self``: the target's
    weights in the draft's format (quantized from the target's values in memory); ``draft``: the
    model at ``spec.model``, which must share the target's tokenizer."""
    if spec is None or not spec.uses_draft_model:
        return None
    quantization = spec.draft_quantization
    if spec.method == "self":
        if quantization == "auto":  # the target's own format: a draft that is the target
            return target
        weights = {name: _requantize(w, quantization, dtype) if is_matrix(name) else w
                   for name, w in target.weights.items()}
        draft_share = matrix_bytes(weights) / matrix_bytes(target.weights)
        if draft_share > SLOW_DRAFT_SHARE:
            logger.warning("the %s self-draft reads %.0f%% of the target's weight bytes per token (the target is "
                           "already quantized): drafting costs about what it saves, so expect no speed-up; "
                           "use the n-gram method, or a float target", quantization, 100 * draft_share)
        return LoadedModel(target.config, weights, target.tokenizer)
    if not Path(spec.model).exists():
        raise SpeculativeConfigError(f"draft model path does not exist: {spec.model}")
    try:
        draft = load_model(spec.model, dtype, quantization=quantization)
    except (ValueError, OSError) as exc:
        raise SpeculativeConfigError(f"cannot load the draft model {spec.model}: {exc}") from exc
    check_same_vocab(target, draft)
    return draft


def matrix_bytes(weights: dict) -> int:
    """Bytes of a model's weight matrices (what a decode step streams)."""
    return sum(w.nbytes if isinstance(w, qw.QuantizedWeight) else w.numel() * w.element_size()
               for name, w in weights.items() if is_matrix(name))


def _requantize(w, quantization: str, dtype: torch.dtype):
    if quantization == "none":
        return qw.dequantize(w, dtype) if isinstance(w, qw.QuantizedWeight) else w
    values = qw.dequantize(w) if isinstance(w, qw.QuantizedWeight) else w.float()
    return qw.quantize(values, quantization)


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Proposals are token ids: the draft must number tokens as the target does."""
    sizes = (target.config.vocab_size, draft.config.vocab_size, target.tokenizer.vocab_size,
             draft.tokenizer.vocab_size)
    if len(set(sizes)) != 1:
        raise SpeculativeConfigError(f"the draft's vocabulary differs from the target's (model / tokenizer "
                                     f"sizes {sizes[0]} / {sizes[2]} vs {sizes[1]} / {sizes[3]})")
    step = max(1, sizes[0] // 997)
    for token_id in range(0, sizes[0], step):
        if target.tokenizer.id_to_token(token_id) != draft.tokenizer.id_to_token(token_id):
            raise SpeculativeConfigError(f"the draft's tokenizer differs from the target's at token id {token_id}")


def num_scratch_blocks(spec: SpeculativeConfig, max_num_seqs: int, block_size: int) -> int:
    """Draft-only blocks for guesses past a sequence's blocks: at most k positions per sequence."""
    return max_num_seqs * math.ceil(spec.num_speculative_tokens / block_size)


