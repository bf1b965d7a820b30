"""The worker: everything that runs the model on this process. It loads the weights, sizes and
allocates the KV cache, picks the attention backend once, and owns the model runner. Executors hold
workers; the engine never sees a tensor."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import torch

from kvmosaic.config import EngineConfig, ModelConfig
from kvmosaic.model.layers.attention import KernelAttention, ReferenceAttention
from kvmosaic.model.layers.backend import AttentionBackend
from kvmosaic.model.layers.quant_attention import QuantizedAttention
from kvmosaic.model.llama import LlamaForCausalLM
from kvmosaic.model.loader import LoadedModel, load_model
from kvmosaic.ops import Kernels
from kvmosaic.ops.memory import release_free_memory
from kvmosaic.outputs import ModelOutput, ScheduledRequest, SchedulerOutput
from kvmosaic.quant import thresholds as kv_thresholds
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.spec.config import SpeculativeConfigError
from kvmosaic.spec.draft_model import load_draft, num_scratch_blocks
from kvmosaic.spec.drafter import CacheSharingDrafter, Drafter, MirroringDrafter
from kvmosaic.worker import kv_sizing
from kvmosaic.worker.kv_cache import KVCache, bytes_per_block, kv_format
from kvmosaic.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

ModelLoader = Callable[[str | None, torch.dtype], LoadedModel]
# Wraps the backend the worker picked (kvmosaic.distributed reaches KV held by other instances).
AttentionWrapper = Callable[[AttentionBackend], AttentionBackend]


def make_attention_backend(model: ModelConfig, kv_cache: KVCache, kernels: Kernels,
                           thresholds: kv_thresholds.KVThresholds | None = None) -> AttentionBackend:
    """The backend for a cache's format and the kernels at hand: chosen once, per worker."""
    if kv_cache.format is not None:
        return QuantizedAttention(model, kv_cache, kernels, thresholds)
    if kernels.ops is not None:
        return KernelAttention(model, kv_cache, kernels.ops)
    return ReferenceAttention(model, kv_cache)


class Worker:
    def __init__(self, config: EngineConfig, loader: ModelLoader | None = None, kernels: Kernels | None = None,
                 attention_wrapper: AttentionWrapper | None = None,
                 thresholds: kv_thresholds.KVThresholds | None = None) -> None:
        """``loader``: reads the weights (default: ``load_model`` in the config's weight format).
        ``thresholds``: Oaken thresholds already in memory (a fresh calibration), instead of the
        file the cache config names."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.kernels = kernels if kernels is not None else Kernels.load()
        loader = loader or functools.partial(load_model, quantization=config.quantization)
        loaded = loader(config.model, config.torch_dtype)
        self.config = config.for_model(loaded.config)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.is_default_model = config.model is None
        self.eos_token_ids = tuple(loaded.tokenizer.eos_token_ids or loaded.config.eos_token_ids)
        self.model = LlamaForCausalLM(loaded.config, loaded.weights, self.kernels,
                                      max_positions=self.config.scheduler.max_model_len).eval()
        self.thresholds = thresholds
        if config.cache.kv_cache_dtype == "oaken" and self.thresholds is None:
            identity = kv_thresholds.ModelIdentity.of(loaded.config, loaded.weights)
            self.thresholds = kv_thresholds.for_model(config.cache.kv_thresholds, identity, self.is_default_model)
        draft = load_draft(config.speculative, loaded, config.torch_dtype)
        if draft is not None and attention_wrapper is not None:
            raise SpeculativeConfigError("a draft model keeps its K/V in the local pool only: "
                                         "not with blocks borrowed from other instances")
        self.draft_config = draft.config if draft is not None else None
        self.draft_shares_cache = draft is not None and config.speculative.draft_shares_cache
        self.sizing: kv_sizing.KVSizing | None = None
        self.kv_cache = self._allocate_cache()
        backend = make_attention_backend(loaded.config, self.kv_cache, self.kernels, self.thresholds)
        self.attention = attention_wrapper(backend) if attention_wrapper is not None else backend
        drafter = self._build_drafter(draft, loaded) if draft is not None else None
        self.runner = ModelRunner(self.model, self.attention, self.eos_token_ids, drafter, self.kernels.argmax)
        del loaded, backend, draft  # the loader's weights dict holds tensors the model copied (fused, packed)
        release_free_memory()  # what loading and the sizing run freed

    def _build_drafter(self, draft: LoadedModel, target: LoadedModel) -> Drafter:
        """The draft model over the target's attention (a self-draft) or over its own companion
        pool (``KVCache.draft``)."""
        max_len, spec = self.config.scheduler.max_model_len, self.config.speculative
        lookup_sizes = (spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.lookup_first else None
        model = self.model if draft is target else LlamaForCausalLM(draft.config, draft.weights, self.kernels,
                                                                     max_positions=max_len).eval()
        sizes = (self.kv_cache.num_blocks, self._num_scratch_blocks, max_len, lookup_sizes, self.kernels.argmax)
        if self.draft_shares_cache:
            return CacheSharingDrafter(ModelRunner(model, self.attention, self.eos_token_ids), *sizes)
        backend = make_attention_backend(draft.config, self.kv_cache.draft, self.kernels)
        return MirroringDrafter(ModelRunner(model, backend, self.eos_token_ids), *sizes)

    # ------------------------------------------------------------------ KV pool
    @property
    def _num_scratch_blocks(self) -> int:
        if self.draft_config is None:
            return 0
        return num_scratch_blocks(self.config.speculative, self.config.scheduler.max_num_seqs,
                                  self.config.cache.block_size)

    def _allocate_cache(self) -> KVCache:
        cfg, cache = self.config, self.config.cache
        fmt = kv_format(self.model_config, cache.kv_cache_dtype, self.thresholds, cache.kv_group_size)
        block_bytes = bytes_per_block(self.model_config, cache.block_size, cfg.torch_dtype, fmt)
        companion = None if self.draft_shares_cache else self.draft_config
        if companion is not None:  # a block holds the draft's K/V of its tokens too
            block_bytes += bytes_per_block(companion, cache.block_size, cfg.torch_dtype)
        host = 0  # recompute preemption never writes a host tier
        if cfg.uses_host_tier:
            host = cache.num_host_blocks if cache.num_host_blocks is not None else cache.swap_space // block_bytes
        if cache.is_auto_sized:
            num_blocks = self._size_pool(block_bytes, host * block_bytes)
        else:
            num_blocks = cache.resolve_num_blocks(block_bytes)[0]
        return KVCache(self.model_config, cache, cfg.torch_dtype, self.thresholds, cache.kv_group_size,
                       num_blocks=num_blocks, num_host_blocks=host, draft=companion,
                       num_scratch_blocks=self._num_scratch_blocks)

    def _size_pool(self, block_bytes: int, host_tier_bytes: int) -> int:
        """Blocks for kv_cache_memory="auto": a share of the RAM left after the activation peak and
        the host swap tier (which fills as requests are swapped out)."""
        peak = kv_sizing.measure_peak_bytes(self._profile_run)
        sched = self.config.scheduler
        self.sizing = kv_sizing.size_kv_pool(
            block_bytes, kv_sizing.available_memory_bytes() - host_tier_bytes, peak,
            max_useful_blocks=sched.max_num_seqs * math.ceil(sched.max_model_len / self.config.cache.block_size),
            memory_utilization=self.config.cache.memory_utilization)
        logger.info("%s", self.sizing.describe())
        return self.sizing.num_blocks

    def _profile_run(self) -> None:
        """One forward over the largest batch the scheduler can form, on a throw-away cache just big
        enough for it: its peak is the activation memory the KV pool must leave room for. One layer
        has the peak of all of them (each reuses the last one's activations) at 1/L of the time."""
        batch = profile_batch(self.config)
        num_blocks = sum(len(s.block_table) for s in batch)
        one_layer = dataclasses.replace(self.model_config, num_hidden_layers=1)
        cache = KVCache(one_layer, self.config.cache, self.config.torch_dtype, self.thresholds,
                        self.config.cache.kv_group_size, num_blocks=num_blocks, num_host_blocks=0)
        backend = make_attention_backend(one_layer, cache, self.kernels, self.thresholds)
        ModelRunner(self.model.first_layers(1), backend, self.eos_token_ids).compute_logits(batch)

    # ------------------------------------------------------------------ execution
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        return self.runner.execute(sched)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.kv_cache.num_host_blocks


def profile_batch(config: EngineConfig) -> list[ScheduledRequest]:
    """Prefill chunks filling the token budget (each at most a chunk long, at most max_num_seqs of
    them), every one sampled, laid over consecutive blocks."""
    sched, block_size = config.scheduler, config.cache.block_size
    chunk = max(1, min(sched.prefill_chunk, sched.max_model_len - 1))
    batch: list[ScheduledRequest] = []
    remaining, next_block = sched.max_num_batched_tokens, 0
    while remaining > 0 and len(batch) < sched.max_num_seqs:
        n = min(chunk, remaining)
        blocks = math.ceil(n / block_size)
        table = list(range(next_block, next_block + blocks))
        batch.append(ScheduledRequest(f"profile-{len(batch)}", [0] * n, 0, table, SamplingParams(),
                                      sample_ids=[f"profile-{len(batch)}"], sample_seeds=[None]))
        remaining -= n
        next_block += blocks
    return batch
