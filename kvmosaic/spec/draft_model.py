"""The worker's side of model-based speculation: a draft model that runs after every step.

Where it runs: in the model runner, after the target's step is sampled and verified (the scheduler
never calls a model). It returns, in the ModelOutput, up to ``num_draft_tokens`` proposals for each
sequence the scheduler asked about; ``DraftedProposer`` hands them over at the next step.

Its K/V: the draft writes into its own per-layer pools over the target's block ids and slot mapping
(``KVCache.draft``). Every step the draft mirrors the target: it runs the tokens the target computed
and kept this step (prefill chunks, a decode's token, accepted proposals) at the same positions, in
the same slots. So wherever the target's K/V is valid the draft's is too: prefix-cache hits, swaps
and copy-on-write (they move both pools), recompute after preemption (both run again), and
rejected proposals (their slots are overwritten when the target computes those positions again).
Only then it drafts: it runs the target's new token and its own guesses, which the target has not
computed; slots past the sequence's blocks go to the draft's scratch blocks, slots inside them are
rewritten by the next mirror. Greedy sequences take the draft's argmax; sampled ones draw from the
draft's distribution q under the request's temperature / top-k / top-p / min-p, and q is returned
so the target's verification applies min(1, p/q). Seeded sampled sequences take the argmax too,
without q: they are verified by the target's own seeded draw (the one-hot rule), so they draw once
per emitted token as plain decoding does and reproduce whatever their batch and its proposals.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmosaic.config import SpeculativeConfig, SpeculativeConfigError
from kvmosaic.model.loader import LoadedModel, is_matrix, load_model
from kvmosaic.outputs import ModelOutput, ScheduledRequest
from kvmosaic.quant import weights as qw
from kvmosaic.sample.sampler import SamplingRow, random_sample, target_probs
from kvmosaic.spec.proposer import Proposal

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


@dataclass(slots=True)
class _Draft:
    request: ScheduledRequest  # the sequence's current draft pass
    k: int
    greedy: bool  # propose the argmax (one-hot); else draw from q, unseeded
    token_ids: list[int]
    probs: list[torch.Tensor]


class Drafter:
    def __init__(self, runner, num_blocks: int, num_scratch_blocks: int, max_positions: int) -> None:
        """``runner``: a ModelRunner over the draft model and its attention on ``KVCache.draft``;
        block ids ``num_blocks`` .. ``num_blocks + num_scratch_blocks - 1`` are the draft's scratch."""
        self.runner = runner
        self.block_size = runner.block_size
        self.num_blocks = num_blocks
        self.num_scratch_blocks = num_scratch_blocks
        self.max_positions = max_positions
        # Decoded tokens not yet mirrored, per sequence: (position of the first, the tokens).
        self._unmirrored: dict[str, tuple[int, list[int]]] = {}

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest], out: ModelOutput) -> dict[str, Proposal]:
        """Mirror the step's kept tokens into the draft's K/V, then draft for the sequences asked.

        Decode tokens of a sequence that drafts nothing this step are only noted and mirrored the
        next time it drafts (one multi-token row), so a draft costs nothing while adaptive k is 0
        (large batches, unpredictable text). Prefill chunks are always mirrored, so prompt blocks,
        the ones prefix hits reuse, carry the draft's K/V. A block of decoded tokens a sequence never
        drafted over holds stale draft K/V; a prefix hit on it costs acceptance, never correctness."""
        scratch = itertools.count(self.num_blocks)
        mirror: list[ScheduledRequest] = []
        drafts: dict[str, _Draft] = {}
        unmirrored: dict[str, tuple[int, list[int]]] = {}
        for s in scheduled:
            kept = s.token_ids[:s.num_tokens - len(s.spec_token_ids) + len(out.accepted.get(s.request_id, ()))]
            start, behind = self._unmirrored.get(s.request_id, (s.start_pos, []))
            if start + len(behind) != s.start_pos:  # recomputed or rolled back since: nothing to carry
                start, behind = s.start_pos, []
            tokens = [*behind, *kept]
            sampled = out.sampled.get(s.request_id) if s.sample_ids else None
            context = start + len(tokens) + 1  # with the target's new token
            k = min(s.num_draft_tokens, self.max_positions - context)
            if k < 1 or sampled is None:
                if s.num_tokens - len(s.spec_token_ids) == 1 and sampled is not None:  # a decode: later
                    unmirrored[s.request_id] = (start, tokens)
                else:
                    mirror.append(ScheduledRequest(s.request_id, tokens, start, s.block_table, s.sampling_params))
                continue
            table = self._with_scratch(s.block_table, context + k - 1, scratch)
            first = ScheduledRequest(s.request_id, [*tokens, sampled.token_id], start, table, s.sampling_params,
                                     sample_ids=[s.request_id])
            mirror.append(first)
            greedy = s.sampling_params.greedy or s.sample_seeds[0] is not None
            drafts[s.request_id] = _Draft(first, k, greedy, [], [])
        self._unmirrored = unmirrored  # sequences not scheduled this step drop theirs (stale K/V later)
        pending = mirror
        while pending:
            requests, logits = self.runner.compute_logits(pending)
            pending = []
            for row, s in enumerate(requests):
                draft = drafts[s.request_id]
                self._choose(draft, logits[row:row + 1])
                if len(draft.token_ids) < draft.k:
                    r = draft.request
                    draft.request = ScheduledRequest(r.request_id, [draft.token_ids[-1]], r.start_pos + r.num_tokens,
                                                     r.block_table, r.sampling_params, sample_ids=[r.request_id])
                    pending.append(draft.request)
        return {seq_id: Proposal(d.token_ids, torch.cat(d.probs) if d.probs else None)
                for seq_id, d in drafts.items()}

    def _choose(self, draft: _Draft, logits: torch.Tensor) -> None:
        if draft.greedy:
            draft.token_ids.append(int(logits.argmax()))
            return
        q = target_probs(logits.float(), [SamplingRow(draft.request.sampling_params, None, [], [])])
        draft.token_ids.append(int(random_sample(q, [None])[0]))
        draft.probs.append(q)

    def _with_scratch(self, table: list[int], num_positions: int, scratch) -> list[int]:
        """The block table extended with scratch blocks to cover ``num_positions`` positions."""
        missing = math.ceil(num_positions / self.block_size) - len(table)
        if missing <= 0:
            return table
        extra = [next(scratch) for _ in range(missing)]
        if extra[-1] >= self.num_blocks + self.num_scratch_blocks:
            raise RuntimeError("the draft ran out of scratch blocks")
        return table + extra
