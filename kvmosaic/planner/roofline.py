"""Roofline model of decode steps: memory, step time, tokens/s, critical batch size.

The model follows "How to Scale Your Model" (ch. 7, inference): in a decode step the
attention reads every sequence's KV cache and is always bandwidth-bound, while the
matmuls read the weights once for the whole batch and cost the larger of their
FLOP time and their weight-load time. Activations are ignored. Pure functions, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Bytes per element of each storage dtype; aliases map onto the short names. The GGUF block formats
# count their scales: Q8_0 34 B / 32 weights, Q4_0 18 / 32, Q4_1 20 / 32, Q4_K 144 / 256, Q6_K 210 / 256.
# "q4k" and "q6" are what the kernels read of a Q4_K / Q6_K matrix as held (kvmosaic.quant.interleaved):
# Q4_K's 6-bit sc and m a byte each (148 / 256), Q6_K's d widened to float32 (212 / 256).
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5,
                                 "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q4_k": 144 / 256,
                                 "q6_k": 210 / 256, "q4k": 148 / 256, "q6": 212 / 256}
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float": "fp32"}
# Matmul arithmetic runs in one of these; fp16 and fp8 share the bf16 / int8 rates here.
_COMPUTE_RATE = {"fp32": "fp32", "bf16": "bf16", "fp16": "bf16", "int8": "int8", "fp8": "int8"}


def format_rate(flops: float) -> str:
    """A FLOP/s figure in the unit that shows three significant digits: "292 MFLOP/s", "21.4 GFLOP/s"."""
    for scale, unit in ((1e12, "TFLOP/s"), (1e9, "GFLOP/s"), (1e6, "MFLOP/s")):
        if flops >= scale:
            value = flops / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{flops:.3g} FLOP/s"


def canonical_dtype(name: str) -> str:
    """``"bfloat16"`` -> ``"bf16"``; raises on an unknown dtype."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_BYTES)}")
    return key


def dtype_bytes(name: str) -> float:
    return DTYPE_BYTES[canonical_dtype(name)]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Decoder-only transformer shape, in the book's letters: L, D, F, N, K, H, V."""

    name: str
    num_layers: int  # L
    hidden_size: int  # D
    intermediate_size: int  # F
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    vocab_size: int  # V
    tie_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        dims = (self.num_layers, self.hidden_size, self.intermediate_size, self.num_heads,
                self.num_kv_heads, self.head_dim, self.vocab_size)
        if min(dims) < 1:
            raise ValueError(f"model {self.name!r}: every dimension must be >= 1, got {dims}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: num_heads must be a multiple of num_kv_heads")


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator chip: memory bandwidth (B/s), memory (B) and peak matmul FLOP/s per dtype
    (None: no figure, e.g. a probe that could not measure it; asking for it is an error)."""

    name: str
    hbm_bandwidth: float
    hbm_bytes: float
    flops_bf16: float | None
    flops_fp32: float | None = None
    flops_int8: float | None = None

    def __post_init__(self) -> None:
        rates = [r for r in (self.flops_bf16, self.flops_fp32, self.flops_int8) if r is not None]
        if self.hbm_bandwidth <= 0 or self.hbm_bytes <= 0 or not rates or min(rates) <= 0:
            raise ValueError(f"hardware {self.name!r}: bandwidth, memory and FLOP/s must be positive")

    def flops(self, compute_dtype: str) -> float:
        """Peak FLOP/s of one chip for matmuls computed in ``compute_dtype``."""
        rate_key = _COMPUTE_RATE.get(canonical_dtype(compute_dtype))
        rate = None if rate_key is None else getattr(self, f"flops_{rate_key}")
        if rate is None:
            raise ValueError(f"{self.name} has no {compute_dtype} FLOP/s figure; choose another --compute-dtype")
        return rate


@dataclass(frozen=True, slots=True)
class Workload:
    """The three numbers the roofline needs about a model stored at given precisions."""

    num_params: float
    weight_bytes: float
    kv_bytes_per_token: float

    def __post_init__(self) -> None:
        if min(self.num_params, self.weight_bytes, self.kv_bytes_per_token) <= 0:
            raise ValueError("workload needs positive parameters, weight bytes and KV bytes per token")


@dataclass(frozen=True, slots=True)
class StepTime:
    """Components of one decode step, in seconds."""

    kv_load_s: float  # attention: every sequence's KV cache read once
    weight_load_s: float  # matmuls, bandwidth side: all weights read once
    matmul_flops_s: float  # matmuls, compute side: 2 FLOPs per parameter per token

    @property
    def mlp_s(self) -> float:
        return max(self.weight_load_s, self.matmul_flops_s)

    @property
    def total_s(self) -> float:
        return self.kv_load_s + self.mlp_s

    @property
    def compute_bound(self) -> bool:
        return self.matmul_flops_s > self.weight_load_s


@dataclass(frozen=True, slots=True)
class PlanRow:
    batch: int
    kv_cache_bytes: float
    total_bytes: float
    fits: bool
    step: StepTime
    tokens_per_s: float


def param_count(model: ModelSpec) -> int:
    """Weights of the checkpoint: projections, MLP, norms, embeddings (+ LM head unless tied)."""
    d, h = model.hidden_size, model.head_dim
    attention = 2 * d * h * (model.num_heads + model.num_kv_heads)  # W_Q, W_O + W_K, W_V
    if model.attention_bias:
        attention += h * (model.num_heads + 2 * model.num_kv_heads)
    mlp = 3 * d * model.intermediate_size  # gate, up, down
    per_layer = attention + mlp + 2 * d  # two RMSNorm weights
    embeddings = model.vocab_size * d * (1 if model.tie_embeddings else 2)
    return model.num_layers * per_layer + embeddings + d  # + final norm


def kv_bytes_per_token(model: ModelSpec, kv_bytes_per_elem: float) -> float:
    """K and V for one token over all layers: 2 * L * K * H * bytes."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * kv_bytes_per_elem


def weight_bytes(num_params: float, weight_bytes_per_param: float) -> float:
    return num_params * weight_bytes_per_param


def workload(model: ModelSpec, weight_bytes_per_param: float, kv_bytes_per_elem: float) -> Workload:
    params = param_count(model)
    return Workload(params, weight_bytes(params, weight_bytes_per_param), kv_bytes_per_token(model, kv_bytes_per_elem))


def default_compute_dtype(weight_bytes_per_param: float) -> str:
    """fp32 weights compute in fp32; anything narrower is upcast to bf16 (the book's int8-weights case)."""
    return "fp32" if weight_bytes_per_param >= 4 else "bf16"


def step_time(work: Workload, hardware: HardwareSpec, batch: int, context_len: int,
              compute_dtype: str, chips: int = 1) -> StepTime:
    """Decode step with ``batch`` sequences of ``context_len`` cached tokens, sharded over ``chips``."""
    if batch < 1 or context_len < 0 or chips < 1:
        raise ValueError("batch and chips must be >= 1 and context_len >= 0")
    bandwidth = chips * hardware.hbm_bandwidth
    return StepTime(
        kv_load_s=batch * context_len * work.kv_bytes_per_token / bandwidth,
        weight_load_s=work.weight_bytes / bandwidth,
        matmul_flops_s=2 * batch * work.num_params / (chips * hardware.flops(compute_dtype)),
    )


def roofline_step_time(model: ModelSpec, hardware: HardwareSpec, batch: int, context_len: int,
                       weight_bytes_per_param: float, kv_bytes_per_elem: float, chips: int = 1,
                       compute_dtype: str | None = None) -> StepTime:
    """Step time of ``model`` from its shape; the entry point for callers outside the planner."""
    work = workload(model, weight_bytes_per_param, kv_bytes_per_elem)
    compute = compute_dtype or default_compute_dtype(weight_bytes_per_param)
    return step_time(work, hardware, batch, context_len, compute, chips)


def tokens_per_second(batch: int, step: StepTime) -> float:
    """One token per sequence per step."""
    return batch / step.total_s


def critical_batch_size(hardware: HardwareSpec, weight_bytes_per_param: float, compute_dtype: str) -> float:
    """Batch where matmul FLOP time equals weight-load time: FLOP/s * bytes_per_param / (2 * bandwidth)."""
    return hardware.flops(compute_dtype) * weight_bytes_per_param / (2 * hardware.hbm_bandwidth)


def max_batch_size(work: Workload, hardware: HardwareSpec, context_len: int, chips: int = 1) -> int:
    """Largest batch whose weights plus KV caches fit in the chips' memory (0 if the weights alone do not)."""
    if context_len < 1:
        raise ValueError("context_len must be >= 1")
    free = chips * hardware.hbm_bytes - work.weight_bytes
    return max(0, math.floor(free / (context_len * work.kv_bytes_per_token)))


def plan(work: Workload, hardware: HardwareSpec, context_len: int, batch_sizes: Sequence[int],
         compute_dtype: str, chips: int = 1) -> list[PlanRow]:
    """One row per batch size: memory, whether it fits, step time and throughput."""
    capacity = chips * hardware.hbm_bytes
    rows = []
    for batch in batch_sizes:
        kv = batch * context_len * work.kv_bytes_per_token
        step = step_time(work, hardware, batch, context_len, compute_dtype, chips)
        total = kv + work.weight_bytes
        rows.append(PlanRow(batch, kv, total, total <= capacity, step, tokens_per_second(batch, step)))
    return rows
