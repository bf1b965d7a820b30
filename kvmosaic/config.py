"""Typed configuration objects shared by every layer.

Each config validates itself in ``__post_init__`` so a bad value fails where it
is created, not deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch

from kvmosaic.config_spec import SpeculativeConfig
from kvmosaic.config_values import WEIGHT_QUANTIZATIONS
from kvmosaic.config_workers import (  # noqa: F401  (declared there; importable from here as before)
    KV_TRANSFER_DTYPES,
    DisaggConfig,
    DistributedConfig,
    RestartPolicy,
    check_kv_transfer_dtype,
)
from kvmosaic.quant.format import KV_CACHE_DTYPES

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COMPUTE_DTYPES = ("auto", *_DTYPES)  # auto: bfloat16 where the CPU has AVX512-BF16, else float32


def parse_memory_size(value: int | float | str) -> int:
    """Turn ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` or a byte count into bytes."""
    if isinstance(value, bool):
        raise ValueError(f"invalid memory size: {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"invalid memory size {value!r}; use e.g. '512MiB' or '2GiB'")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return size


def default_dtype() -> torch.dtype:
    """bfloat16 where the CPU has native bf16 dot products (AVX512-BF16), else float32."""
    return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if dtype == "auto":
        return default_dtype()
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported compute dtype {dtype}; use float32 or bfloat16")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported compute dtype {dtype!r}; use auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture hyper-parameters, in Hugging Face naming (frozen: a changed one is a new config,
    ``dataclasses.replace``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token over all layers."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: block size, device pool budget, host swap tier."""

    block_size: int = 16
    # "auto": profile the model's peak activation memory and take a share of the RAM still available
    # (kvmosaic.worker.kv_sizing); or a fixed budget such as "1GiB".
    kv_cache_memory: int | str = "auto"
    memory_utilization: float = 0.5  # with "auto": the share of available RAM (after activations) for KV
    swap_space: int | str = "1GiB"  # host tier, allocated only with preemption_mode="swap"
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # overrides the memory budget when set (tests)
    num_host_blocks: int | None = None
    kv_cache_dtype: str = "auto"  # auto (compute dtype), int8, int4, oaken
    kv_thresholds: str | None = None  # Oaken calibration file; None: the one shipped for the default model
    kv_group_size: int | None = None  # int8 / int4: one scale per this many values (default: per head vector)
    # write every page of the device pool when it is created, as vLLM and llama.cpp reserve their KV
    # caches: the whole pool is resident from the start and no step pays the first write of a page
    # (in a VM ~1.5 s of a 13 s 64 x 256-token batch, benchmark B). False: pages become resident as
    # blocks are first written (memory follows use).
    prefault: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_memory != "auto":
            object.__setattr__(self, "kv_cache_memory", parse_memory_size(self.kv_cache_memory))
        object.__setattr__(self, "swap_space", parse_memory_size(self.swap_space) if self.swap_space else 0)
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.num_host_blocks is not None and self.num_host_blocks < 0:
            raise ValueError("num_host_blocks must be >= 0")

    @property
    def is_auto_sized(self) -> bool:
        """Whether the device pool is sized by profiling (no block count and no fixed budget)."""
        return self.num_blocks is None and self.kv_cache_memory == "auto"

    def resolve_num_blocks(self, bytes_per_block: int) -> tuple[int, int]:
        """(device blocks, host blocks) that a fixed budget buys for a given block footprint."""
        if self.num_blocks is not None:
            device = self.num_blocks
        elif self.kv_cache_memory == "auto":
            raise ValueError("kv_cache_memory='auto' is sized by the worker's profiling run")
        else:
            device = self.kv_cache_memory // bytes_per_block
        host = self.num_host_blocks if self.num_host_blocks is not None else self.swap_space // bytes_per_block
        if device < 1:
            raise ValueError(
                f"kv_cache_memory={self.kv_cache_memory} bytes holds no block of {bytes_per_block} bytes"
            )
        return int(device), int(host)


PREEMPTION_MODES = ("recompute", "swap")
MAX_SCHEDULER_STEPS = 64


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192  # within what the model supports (EngineConfig.for_model)
    preemption_mode: str = "recompute"
    # A single prefill chunk never exceeds this (chunked prefill); 0 means the token budget.
    long_prefill_token_threshold: int = 0
    # Forward passes a decode-only step runs before the scheduler looks again (vLLM's multi-step
    # scheduling): each sequence feeds its sampled token straight back, so the scheduling and output
    # work between passes happens once per this many tokens.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not 1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS:
            raise ValueError(f"num_scheduler_steps must be in [1, {MAX_SCHEDULER_STEPS}]")

    @property
    def prefill_chunk(self) -> int:
        return self.long_prefill_token_threshold or self.max_num_batched_tokens


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"
    # weight format: "auto" (a GGUF's quantized matrices kept), None / "none" (all float), q8_0, q4_0, q4_1,
    # q4_k, q6_k
    quantization: str | None = "auto"
    seed: int = 0
    num_threads: int | None = None
    # a request's greedy tokens (and seeded samples) independent of the batch, the chunking, the prefix
    # cache and speculation; False lets the kernels take row-count-dependent faster paths
    # (kvmosaic.ops: set_batch_invariant)
    deterministic: bool = True
    # a GGUF's weights kept on disk in the kernels' layout, mapped at the next start (kvmosaic.model.weight_cache)
    weight_cache: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        if self.quantization is not None and str(self.quantization).lower() not in WEIGHT_QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of "
                             f"{', '.join(WEIGHT_QUANTIZATIONS)} or None")
        if self.speculative is not None and self.scheduler.num_scheduler_steps > 1:
            raise ValueError("speculative decoding and num_scheduler_steps > 1 cannot be combined")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def uses_host_tier(self) -> bool:
        """Only swap preemption ever writes to the host tier."""
        return self.scheduler.preemption_mode == "swap"

    def for_model(self, model: ModelConfig) -> EngineConfig:
        """A new config with what depends on the model resolved (the context length it supports)."""
        max_len = min(self.scheduler.max_model_len, model.max_position_embeddings)
        if max_len == self.scheduler.max_model_len:
            return self
        return dataclasses.replace(self, scheduler=dataclasses.replace(self.scheduler, max_model_len=max_len))
