"""A worker starts in three phases, each a function of what the last returned (as vLLM's workers do):

1. ``load_weights``: the model (and a draft model) in memory, the config resolved against it;
2. ``plan_kv_cache``: memory measured (one profiling pass at the largest batch) and the pool sized;
3. ``build_attention``: the KV cache allocated for that plan and its attention backend picked.

``Worker.start`` runs them in order. A caller that needs the pool's size before the backend exists
(a distributed instance builds its rManager over those blocks, then wraps the backend) runs them
itself and hands the worker what they returned."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmosaic.attention.backend import AttentionBackend
from kvmosaic.attention.build import make_attention_backend
from kvmosaic.attention.kv_cache import KVCache, bytes_per_block, kv_format
from kvmosaic.config import EngineConfig, ModelConfig
from kvmosaic.model.llama import LlamaForCausalLM
from kvmosaic.model.loader import LoadedModel, load_model
from kvmosaic.model.weight_cache import packed_store
from kvmosaic.ops import Kernels
from kvmosaic.outputs import ScheduledRequest
from kvmosaic.quant import thresholds as kv_thresholds
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.worker import kv_sizing
from kvmosaic.worker.draft_model import load_draft, num_scratch_blocks
from kvmosaic.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

ModelLoader = Callable[[str | None, torch.dtype], LoadedModel]


@dataclass(slots=True)
class LoadedWeights:
    """Phase 1's result: the target model built from its weights, and what the later phases need."""

    config: EngineConfig  # resolved against the model (``EngineConfig.for_model``)
    model_config: ModelConfig
    model: LlamaForCausalLM
    kernels: Kernels
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    thresholds: kv_thresholds.KVThresholds | None  # Oaken's, when the cache is Oaken
    draft: LoadedModel | None  # the draft model's weights (speculation), or None
    draft_is_target: bool  # a self-draft in the target's own format: the target runs as its draft
    target: LoadedModel | None  # the loader's result, held until the worker is built (then released)

    @property
    def draft_config(self) -> ModelConfig | None:
        return self.draft.config if self.draft is not None else None

    @property
    def draft_shares_cache(self) -> bool:
        return self.draft is not None and self.config.speculative.draft_shares_cache

    @property
    def num_scratch_blocks(self) -> int:
        if self.draft is None:
            return 0
        return num_scratch_blocks(self.config.speculative, self.config.scheduler.max_num_seqs,
                                  self.config.cache.block_size)

    def release(self) -> None:
        """Drop the loader's tensors (the model holds its own copies: fused, packed)."""
        self.target = self.draft = None


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """Phase 2's result: the pool sizes, and the sizing decision when memory was measured."""

    num_blocks: int
    num_host_blocks: int
    sizing: kv_sizing.KVSizing | None = None  # None: a fixed budget (no measuring)


def load_weights(config: EngineConfig, loader: ModelLoader | None = None, kernels: Kernels | None = None,
                 thresholds: kv_thresholds.KVThresholds | None = None) -> LoadedWeights:
    """Phase 1. ``loader``: reads the weights (default: ``load_model`` in the config's weight format);
    ``thresholds``: Oaken thresholds already in memory (a fresh calibration), instead of the file the
    cache config names."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    kernels = kernels if kernels is not None else Kernels.load()
    kernels.set_batch_invariant(config.deterministic)
    loader = loader or functools.partial(load_model, quantization=config.quantization,
                                         weight_cache=config.weight_cache)
    loaded = loader(config.model, config.torch_dtype)
    resolved = config.for_model(loaded.config)
    packed = packed_store(loaded.cache_source, kernels)
    model = LlamaForCausalLM(loaded.config, loaded.weights, kernels,
                             max_positions=resolved.scheduler.max_model_len, packed=packed).eval()
    packed.finish()
    if config.cache.kv_cache_dtype == "oaken" and thresholds is None:
        identity = kv_thresholds.ModelIdentity.of(loaded.config, loaded.weights)
        thresholds = kv_thresholds.for_model(config.cache.kv_thresholds, identity, config.model is None)
    draft = load_draft(config.speculative, loaded, config.torch_dtype)
    return LoadedWeights(resolved, loaded.config, model, kernels, loaded.tokenizer,
                         tuple(loaded.tokenizer.eos_token_ids or loaded.config.eos_token_ids), thresholds, draft,
                         draft is loaded, loaded)


def plan_kv_cache(weights: LoadedWeights) -> KVCachePlan:
    """Phase 2: the pool's blocks; with kv_cache_memory="auto" a share of the RAM left after the
    activation peak (one profiling pass) and the host swap tier (which fills as requests are swapped out)."""
    cfg, cache = weights.config, weights.config.cache
    fmt = kv_format(weights.model_config, cache.kv_cache_dtype, weights.thresholds, cache.kv_group_size,
                    cache.block_size)
    block_bytes = bytes_per_block(weights.model_config, cache.block_size, cfg.torch_dtype, fmt)
    if weights.draft is not None and not weights.draft_shares_cache:  # a block holds the draft's K/V too
        block_bytes += bytes_per_block(weights.draft.config, cache.block_size, cfg.torch_dtype)
    host = 0  # recompute preemption never writes a host tier
    if cfg.uses_host_tier:
        host = cache.num_host_blocks if cache.num_host_blocks is not None else cache.swap_space // block_bytes
    if not cache.is_auto_sized:
        return KVCachePlan(cache.resolve_num_blocks(block_bytes)[0], host)
    peak = kv_sizing.measure_peak_bytes(functools.partial(_profile_run, weights))
    sched = cfg.scheduler
    sizing = kv_sizing.size_kv_pool(
        block_bytes, kv_sizing.available_memory_bytes() - host * block_bytes, peak,
        max_useful_blocks=sched.max_num_seqs * math.ceil(sched.max_model_len / cache.block_size),
        memory_utilization=cache.memory_utilization)
    logger.info("%s", sizing.describe())
    return KVCachePlan(sizing.num_blocks, host, sizing)


def build_attention(weights: LoadedWeights, plan: KVCachePlan) -> AttentionBackend:
    """Phase 3: the KV cache of the plan's sizes and the backend over it (``backend.kv_cache``)."""
    cfg, cache = weights.config, weights.config.cache
    companion = None if weights.draft_shares_cache else weights.draft_config
    kv_cache = KVCache(weights.model_config, cache, cfg.torch_dtype, weights.thresholds, cache.kv_group_size,
                       num_blocks=plan.num_blocks, num_host_blocks=plan.num_host_blocks, draft=companion,
                       num_scratch_blocks=weights.num_scratch_blocks)
    return make_attention_backend(weights.model_config, kv_cache, weights.kernels, weights.thresholds)


def _profile_run(weights: LoadedWeights) -> None:
    """One forward over the largest batch the scheduler can form, on a throw-away cache just big
    enough for it: its peak is the activation memory the KV pool must leave room for. One layer
    has the peak of all of them (each reuses the last one's activations) at 1/L of the time."""
    config = weights.config
    batch = profile_batch(config)
    num_blocks = sum(len(s.block_table) for s in batch)
    one_layer = dataclasses.replace(weights.model_config, num_hidden_layers=1)
    cache = KVCache(one_layer, config.cache, config.torch_dtype, weights.thresholds, config.cache.kv_group_size,
                    num_blocks=num_blocks, num_host_blocks=0)
    backend = make_attention_backend(one_layer, cache, weights.kernels, weights.thresholds)
    ModelRunner(weights.model.first_layers(1), backend, weights.eos_token_ids).compute_logits(batch)


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
