"""Read a llama.cpp GGUF file into HF-named float tensors, a ModelConfig and a Tokenizer."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch

from kvmosaic.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvmosaic.model.gguf_file import GGUFFile, GGUFTensor
from kvmosaic.model.gguf_tokenizer import gguf_eos_token_ids, gguf_field
from kvmosaic.model.tokenizer import Tokenizer
from kvmosaic.ops.memory import drop_mapped_pages
from kvmosaic.quant import weights as qw

logger = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
# Types gguf.quants can dequantize that real llama/qwen2 GGUFs use.
SUPPORTED_TENSOR_TYPES = frozenset(
    (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
)

# GGUF float types: the numpy type that holds their bits, and their PyTorch dtype.
_FLOAT_VIEWS = {Q.F32: (np.float32, torch.float32), Q.F16: (np.float16, torch.float16),
                Q.BF16: (np.int16, torch.bfloat16)}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_IGNORED = {"rope_freqs.weight"}  # folded into ModelConfig.rope_scaling


def load_gguf(path: Path, dtype: torch.dtype, keep_quantized: bool = False, cache: bool = False
              ) -> tuple[ModelConfig, GGUFWeights, Tokenizer]:
    """``keep_quantized``: matrices of a type the kernels run natively (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) stay
    quantized (``QuantizedWeight``), those of the other quantized types are held as Q8_0
    (``qw.requantize``); everything else is dequantized to ``dtype``. The weights are read from the
    file's mapping when asked for (``GGUFWeights``). ``cache``: the tokenizer's description is kept in
    the weight cache (``kvmosaic.model.weight_cache``)."""
    reader = GGUFFile(path)
    fields = reader.fields
    if gguf_field(fields, "split.count", 1) > 1:
        raise ValueError(f"{path} is one shard of a split GGUF; merge it with llama-gguf-split --merge first")
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_model_config(fields, tensors)
    tokenizer = Tokenizer.from_gguf(fields, path if cache else None)  # before any weight: a bad vocab fails fast
    return config, GGUFWeights(tensors, config, dtype, keep_quantized), tokenizer


class GGUFWeights(Mapping):
    """A GGUF's weights under HF names, each unpacked from the file's mapping when it is read and not
    kept: a model that takes its products from the repack-once cache reads only its norms and
    biases, and one that builds them holds each unpacked matrix only until it is packed."""

    def __init__(self, tensors: Mapping[str, GGUFTensor], config: ModelConfig, dtype: torch.dtype,
                 keep_quantized: bool) -> None:
        self._tensors, self._config, self._dtype, self._keep_quantized = tensors, config, dtype, keep_quantized
        self._names: dict[str, GGUFTensor] = {}
        for name, tensor in tensors.items():
            hf_name = hf_tensor_name(name)
            if hf_name is not None:
                self._names[hf_name] = tensor
            elif name not in _IGNORED:
                logger.warning("ignoring unexpected GGUF tensor %s", name)

    def __getitem__(self, name: str) -> torch.Tensor | qw.QuantizedWeight:
        tensor = self._names[name]
        weight = _gguf_weight(tensor, name, self._config, self._dtype, self._keep_quantized)
        # every weight comes out as a copy: its file pages need not stay in this process's RSS
        drop_mapped_pages(tensor.data.ctypes.data, tensor.data.nbytes)
        return weight

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the weight
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF shape of weight ``name`` (out_features, in_features), without reading it."""
        return tuple(int(d) for d in reversed(self._names[name].shape.tolist()))


def _gguf_weight(tensor: GGUFTensor, hf_name: str, config: ModelConfig, dtype: torch.dtype,
                 keep_quantized: bool) -> torch.Tensor | qw.QuantizedWeight:
    qtype = Q(tensor.tensor_type)
    matrix = keep_quantized and len(tensor.shape) == 2
    native = matrix and qtype in qw.NATIVE_TYPES
    if native:
        weight = qw.from_gguf(tensor.data, qtype)
    elif len(tensor.shape) == 2 and qtype in qw.NATIVE_TYPES:
        # our dequantization equals gguf's bit for bit, in vectorized torch: the default model's
        # float load takes ~0.3 s of it instead of ~2.2 s
        weight = qw.dequantize(qw.from_gguf(tensor.data, qtype), torch.float32)
    else:  # float types straight to the model's dtype; other types through float32 (requantized or cast)
        weight = dequantize_tensor(tensor, dtype if qtype in _FLOAT_VIEWS else torch.float32)
    heads = _permuted_heads(config, hf_name)
    if heads and native:  # rows move whole: permute the quantized rows
        weight = weight.rows(unpermute_qk(torch.arange(weight.shape[0]), heads))
    elif heads:
        weight = unpermute_qk(weight, heads)
    if native:
        return weight
    if matrix and qtype in qw.REQUANTIZED_TYPES:
        return qw.requantize(weight, qtype.name)
    return weight.to(dtype)


def _permuted_heads(config: ModelConfig, hf_name: str) -> int:
    """Heads of a q/k tensor llama.cpp's converter permuted (0: not permuted)."""
    if config.architecture != "llama":
        return 0
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return config.num_attention_heads
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return config.num_key_value_heads
    return 0


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def dequantize_tensor(tensor: GGUFTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor's values in ``dtype`` (float32: exactly gguf's dequantization), in PyTorch
    (out_features, in_features) order. A float tensor already in ``dtype`` is not widened first."""
    qtype = Q(tensor.tensor_type)
    if qtype not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
        raise ValueError(f"tensor {tensor.name!r} has unsupported GGUF type {qtype.name}; supported: {supported}")
    # GGUF lists dimensions innermost first; PyTorch wants them outermost first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if qtype in _FLOAT_VIEWS:  # float bits as they are: widened in PyTorch (exact), not through gguf's numpy
        bits = _file_bytes(tensor).view(_FLOAT_VIEWS[qtype][0])
        return torch.from_numpy(bits).view(_FLOAT_VIEWS[qtype][1]).reshape(shape).to(dtype)
    values = gguf.quants.dequantize(tensor.data, qtype)
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    if not values.flags.writeable:  # F32 data is a read-only view of the mmap
        values = values.copy()
    return torch.from_numpy(values).to(dtype)


def _file_bytes(tensor: GGUFTensor) -> np.ndarray:
    """A copy of the tensor's bytes, read from its file with one call where it has one: faulting a
    large mapping in page by page costs several times the copy (4 s against 1 s for 3.4 GB)."""
    if getattr(tensor, "path", None) is None:  # gguf's own reader's tensors: from the mapping
        return np.array(np.ascontiguousarray(tensor.data).view(np.uint8))
    out = np.empty(int(tensor.n_bytes), np.uint8)
    with open(tensor.path, "rb", buffering=0) as f:
        view, offset = memoryview(out), tensor.offset
        while view.nbytes:
            n = os.preadv(f.fileno(), [view], offset)
            if n <= 0:
                raise ValueError(f"{tensor.path} ends inside tensor {tensor.name!r}")
            view, offset = view[n:], offset + n
    return out


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf row permutation of q_proj / k_proj.

    The converter maps each head's rows with reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2),
    so the inverse reads rows as (n_head, head_dim // 2, 2, ...) and swaps back.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot unpermute {rows} rows over {num_heads} heads")
    rest = weight.shape[1:]
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return split.transpose(1, 2).reshape(rows, *rest).contiguous()


def gguf_model_config(fields: Mapping, tensors: Mapping[str, GGUFTensor]) -> ModelConfig:
    arch = gguf_field(fields, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    key = lambda name, default=None: gguf_field(fields, f"{arch}.{name}", default)
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    theta = _f32(key("rope.freq_base", 10000.0))
    tokens = gguf_field(fields, "tokenizer.ggml.tokens", [])
    bos = gguf_field(fields, "tokenizer.ggml.bos_token_id", None)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(key("vocab_size", 0) or len(tokens) or tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(fields, arch, tensors, head_dim, theta),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=gguf_eos_token_ids(fields),
        name=str(gguf_field(fields, "general.name", "")),
    )


def _f32(value: float) -> float:
    # GGUF stores float32; its shortest repr (1e-05, not 9.99999974e-06) is what the model author wrote.
    return float(str(np.float32(value)))


def _rope_scaling(fields: Mapping, arch: str, tensors: Mapping, head_dim: int, theta: float) -> dict | None:
    """HF-style rope_scaling dict from llama.cpp's rope.scaling.* keys or a rope_freqs tensor."""
    key = lambda name, default=None: gguf_field(fields, f"{arch}.rope.scaling.{name}", default)
    kind = key("type", "none")
    if "rope_freqs.weight" in tensors:
        if kind != "none":
            raise ValueError(f"GGUF has both rope_freqs and rope scaling type {kind!r}")
        return _llama3_scaling(dequantize_tensor(tensors["rope_freqs.weight"]), head_dim, theta)
    if kind == "none" or key("factor", 1.0) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(key("factor"))}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": _f32(key("factor"))}
        optional = {"original_max_position_embeddings": "original_context_length", "attention_factor": "attn_factor",
                    "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}
        scaling.update({hf: key(name) for hf, name in optional.items() if key(name) is not None})
        return scaling
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


def _llama3_scaling(freq_factors: torch.Tensor, head_dim: int, theta: float) -> dict | None:
    """llama.cpp stores Llama-3 rope scaling as per-frequency divisors; recover the HF parameters.

    Every released Llama 3.x uses low/high frequency factors 1 and 4 over an 8192 original
    context, so only the factor is free: solve it from the lowest frequency, then check the
    whole tensor against those parameters before trusting them.
    """
    scaling = {"rope_type": "llama3", "factor": 1.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    wavelen = 2 * math.pi * theta ** ((head_dim - 2) / head_dim)
    smooth = min(max((8192 / wavelen - 1.0) / (4.0 - 1.0), 0.0), 1.0)
    if smooth == 1.0:  # every frequency is above the scaled band: the factors change nothing
        return None
    last = float(freq_factors[-1])
    # Inverts 1 / ((1 - smooth) / factor + smooth), which is just `factor` when smooth is 0.
    denominator = 1 / last - smooth if last > 0 else 0.0
    if denominator > 0:
        scaling["factor"] = round((1 - smooth) / denominator, 4)
    if denominator <= 0 or not torch.allclose(freq_factors, llama3_freq_factors(scaling, head_dim, theta), rtol=1e-4):
        raise ValueError("GGUF rope_freqs tensor does not match any supported Llama-3 rope scaling")
    return scaling


def llama3_freq_factors(scaling: dict, head_dim: int, theta: float) -> torch.Tensor:
    """The divisors llama.cpp's converter writes to rope_freqs for a llama3 rope_scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_context / wavelen - low) / (high - low)).clamp(0, 1)
    factors = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelen < old_context / high, 1.0, factors)
    return torch.where(wavelen > old_context / low, factor, factors).float()
