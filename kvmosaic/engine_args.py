"""Every engine option, declared once: ``EngineArgs``. ``LLM(**options)`` takes exactly its fields, the
``generate``, ``chat`` and ``serve`` commands have a flag for each (kvmosaic.options), and
``create_engine_configs`` is the one place that turns the options into the configs an engine is built from.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from kvmosaic.config import (
    COMPUTE_DTYPES,
    KV_TRANSFER_DTYPES,
    PREEMPTION_MODES,
    WEIGHT_QUANTIZATIONS,
    CacheConfig,
    DisaggConfig,
    DistributedConfig,
    EngineConfig,
    RestartPolicy,
    SchedulerConfig,
    SpeculativeConfig,
    parse_memory_size,
)
from kvmosaic.options import option
from kvmosaic.quant.format import KV_CACHE_DTYPES


def memory_size_or_auto(text: str) -> str:
    """A flag's memory size ("2GiB") or "auto", checked and kept as written."""
    if text != "auto":
        _checked_size(text)
    return text


def memory_size_or_zero(text: str) -> str | int:
    """A flag's memory size, or 0 for none."""
    if text.strip() == "0":
        return 0
    _checked_size(text)
    return text


def _checked_size(text: str) -> None:
    try:
        parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def speculative_json(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:  # SpeculativeConfigError
        raise argparse.ArgumentTypeError(str(exc)) from exc


@dataclass(frozen=True)
class EngineConfigs:
    """What one engine client is built from: the engine's config, plus the distributed KV cache's
    (instances on Ray lending each other blocks) or disaggregation's (prefill and decode workers), if any."""

    engine: EngineConfig
    distributed: DistributedConfig | None = None
    disagg: DisaggConfig | None = None


@dataclass(frozen=True, slots=True)
class EngineArgs:
    # --- model and weights
    model: str | None = option(
        None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct GGUF)")
    dtype: str = option(
        "auto", choices=COMPUTE_DTYPES, help="compute dtype; auto: bfloat16 on CPUs with AVX512-BF16, else float32")
    quantization: str | None = option(
        "auto", choices=WEIGHT_QUANTIZATIONS,
        help="weight format: auto (a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices run natively, an HF directory "
             "stays float), none (every weight dequantized to the compute dtype), or q8_0 / q4_0 / q4_1 / q4_k / "
             "q6_k (quantized at load)")
    seed: int = option(0, help="the engine's seed (EngineConfig.seed); a request's draws follow its own seed")
    deterministic: bool = option(
        True, help="batch-invariant kernels: a request's output does not depend on the requests beside it, the "
                   "prefill chunking, the prefix cache or speculation (--no-deterministic: faster paths on AMX)")
    weight_cache: bool = option(
        True, help="keep a GGUF's weights on disk in the kernels' layout (KVMOSAIC_CACHE_DIR, default "
                   "~/.cache/kvmosaic) and map them at the next start instead of repacking the file again")
    num_threads: int | None = option(
        None, flags=("--threads",),
        help="torch threads (default: every core; with instances > 1, the cores shared among them)")
    # --- KV cache
    kv_cache_memory: int | str = option(
        "auto", parse=memory_size_or_auto, metavar="SIZE",
        help="KV pool size such as 2GiB; auto: profile the model, then take memory_utilization of the RAM "
             "still available")
    memory_utilization: float = option(
        0.5, help="with kv_cache_memory auto: the share of available RAM (after activations) the KV pool may take")
    kv_cache_prefault: bool = option(
        False, help="make the whole KV pool resident at start (else page by page as blocks are first written)")
    block_size: int = option(16, help="tokens per KV block")
    swap_space: int | str = option(
        "1GiB", parse=memory_size_or_zero, metavar="SIZE",
        help="host tier for preempted sequences' KV, allocated only with preemption_mode swap (0: none)")
    enable_prefix_caching: bool = option(
        True, flags=("--no-prefix-caching",), help="reuse the KV blocks of prompt prefixes seen before")
    num_blocks: int | None = option(None, help="device KV blocks, overriding kv_cache_memory")
    num_host_blocks: int | None = option(None, help="host KV blocks, overriding swap_space")
    kv_cache_dtype: str = option(
        "auto", choices=KV_CACHE_DTYPES,
        help="KV cache storage: auto (the compute dtype), bf16 (half of a float32 cache), int8, int4 or oaken")
    kv_thresholds: str | None = option(
        None, help="Oaken thresholds file from `kvmosaic calibrate-kv` (default: the one shipped for the "
                   "default model)")
    kv_group_size: int | None = option(
        None, help="int8 / int4 KV: one scale per this many values (default: one per head vector)")
    # --- scheduler
    max_num_batched_tokens: int = option(2048, help="token budget of one engine step")
    max_num_seqs: int = option(128, help="sequences in one running batch")
    max_model_len: int = option(8192, help="longest sequence, prompt and output (at most what the model supports)")
    preemption_mode: str = option(
        "recompute", choices=PREEMPTION_MODES,
        help="what happens to a sequence preempted for lack of KV blocks: recompute its KV later, or swap it "
             "to the host tier")
    long_prefill_token_threshold: int = option(
        0, help="longest prefill chunk of one sequence in a step (0: the token budget)")
    num_scheduler_steps: int = option(
        1, help="forward passes a decode-only step runs, each sequence feeding its sampled token back, before the "
                "scheduler runs again (multi-step decoding)")
    speculative: SpeculativeConfig | dict | str | None = option(
        None, parse=speculative_json, flags=("--speculative-config",), metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (SpeculativeConfig; adaptive k unless '
             '"adaptive": false)')
    # --- distributed KV cache (kvmosaic.distributed) and disaggregated serving (kvmosaic.disagg)
    instances: int = option(
        1, help="engine instances as Ray actors lending each other KV blocks (each gets kv_cache_memory)")
    ray_address: str | None = option(None, help="join this Ray cluster instead of starting a local runtime")
    enable_borrowing: bool = option(
        True, flags=("--no-borrowing",), help="with instances > 1: borrow KV blocks across instances")
    cluster_secret_file: str | None = option(
        None, help="with instances > 1: the data plane's shared secret (hex or text) for instances started apart "
                   "(else KVMOSAIC_CLUSTER_SECRET; neither: a new one per run)")
    max_worker_restarts: int = option(
        3, help="with instances or prefill/decode workers: times an actor that died or hung is replaced (per "
                "worker, within RestartPolicy.window; 0: a lost one stays lost)")
    prefill_workers: int = option(
        0, help="disaggregated serving: prefill workers as Ray actors (with decode_workers)")
    decode_workers: int = option(
        0, help="disaggregated serving: decode workers as Ray actors; prompts' K/V moves to them")
    kv_transfer_dtype: str = option(
        "auto", choices=KV_TRANSFER_DTYPES,
        help="disaggregated serving: send a float cache's prompt K/V as int8 records (~4x fewer bytes than "
             "float32) instead of as the cache holds it")

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("prefill_workers and decode_workers must be >= 0")
        if self.instances > 1 and self.disaggregated:
            raise ValueError("choose instances > 1 (the distributed KV cache) or prefill/decode workers "
                             "(disaggregated serving), not both")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_workers or self.decode_workers)

    @property
    def distributed(self) -> bool:
        """Instances on Ray: more than one, or one that joins a Ray cluster (without disaggregation)."""
        return not self.disaggregated and (self.instances > 1 or bool(self.ray_address))

    def as_kwargs(self) -> dict:
        """The options as keyword arguments (of ``LLM``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def create_engine_configs(self) -> EngineConfigs:
        """The configs these options ask for; each validates its part (ValueError)."""
        num_threads = self.num_threads
        if self.distributed and num_threads is None:  # the instances share the cores
            num_threads = max(1, (os.cpu_count() or 1) // self.instances)
        cache = CacheConfig(
            block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
            memory_utilization=self.memory_utilization, swap_space=self.swap_space,
            enable_prefix_caching=self.enable_prefix_caching, num_blocks=self.num_blocks,
            num_host_blocks=self.num_host_blocks, kv_cache_dtype=self.kv_cache_dtype,
            kv_thresholds=self.kv_thresholds, kv_group_size=self.kv_group_size, prefault=self.kv_cache_prefault)
        scheduler = SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len, preemption_mode=self.preemption_mode,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            num_scheduler_steps=self.num_scheduler_steps)
        engine = EngineConfig(model=self.model, dtype=self.dtype, quantization=self.quantization, seed=self.seed,
                              deterministic=self.deterministic, weight_cache=self.weight_cache,
                              num_threads=num_threads, cache=cache,
                              scheduler=scheduler, speculative=self.speculative)
        restart = RestartPolicy(max_restarts=self.max_worker_restarts)
        if self.disaggregated:  # ray_address goes to the workers
            return EngineConfigs(engine, disagg=DisaggConfig(
                prefill_workers=max(1, self.prefill_workers), decode_workers=max(1, self.decode_workers),
                ray_address=self.ray_address, kv_transfer_dtype=self.kv_transfer_dtype, restart=restart))
        if self.distributed:
            return EngineConfigs(engine, distributed=DistributedConfig(
                num_instances=self.instances, ray_address=self.ray_address, enable_borrowing=self.enable_borrowing,
                cluster_secret_file=self.cluster_secret_file, restart=restart))
        return EngineConfigs(engine)
