"""The worker: everything that runs the model on this process. It is built from the results of the
start-up phases (``startup.py``: weights loaded, memory measured, KV cache and attention backend
built) and owns the model runner (and a draft model's runner). Executors hold workers; the engine
never sees a tensor."""

from __future__ import annotations

from kvmosaic.attention.backend import AttentionBackend
from kvmosaic.attention.build import make_attention_backend
from kvmosaic.config import EngineConfig
from kvmosaic.model.llama import LlamaForCausalLM
from kvmosaic.ops import Kernels
from kvmosaic.ops.memory import release_free_memory
from kvmosaic.outputs import ModelOutput, SchedulerOutput
from kvmosaic.quant import thresholds as kv_thresholds
from kvmosaic.worker.drafter import CacheSharingDrafter, Drafter, MirroringDrafter
from kvmosaic.worker.model_runner import ModelRunner
from kvmosaic.worker.startup import (
    KVCachePlan,
    LoadedWeights,
    ModelLoader,
    build_attention,
    load_weights,
    plan_kv_cache,
)


class Worker:
    def __init__(self, weights: LoadedWeights, plan: KVCachePlan, attention: AttentionBackend) -> None:
        """``attention``: the backend phase 3 built over the plan's cache, or a wrapper of it (a
        distributed instance's, which reaches KV held by other instances)."""
        self.config = weights.config
        self.model_config = weights.model_config
        self.tokenizer = weights.tokenizer
        self.eos_token_ids = weights.eos_token_ids
        self.kernels = weights.kernels
        self.model = weights.model
        self.thresholds = weights.thresholds
        self.sizing = plan.sizing
        self.attention = attention
        self.kv_cache = attention.kv_cache
        drafter = self._build_drafter(weights) if weights.draft is not None else None
        self.runner = ModelRunner(self.model, attention, self.eos_token_ids, drafter, self.kernels.argmax)
        weights.release()
        release_free_memory()  # what loading and the sizing run freed

    @classmethod
    def start(cls, config: EngineConfig, loader: ModelLoader | None = None, kernels: Kernels | None = None,
              thresholds: kv_thresholds.KVThresholds | None = None) -> Worker:
        """A worker through every phase, its backend the one phase 3 picked (see ``load_weights``)."""
        weights = load_weights(config, loader, kernels, thresholds)
        plan = plan_kv_cache(weights)
        return cls(weights, plan, build_attention(weights, plan))

    def _build_drafter(self, weights: LoadedWeights) -> Drafter:
        """The draft model over the target's attention (a self-draft) or over its own companion
        pool (``KVCache.draft``)."""
        draft, max_len, spec = weights.draft, self.config.scheduler.max_model_len, self.config.speculative
        lookup_sizes = (spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.lookup_first else None
        model = self.model if weights.draft_is_target else LlamaForCausalLM(
            draft.config, draft.weights, self.kernels, max_positions=max_len).eval()
        sizes = (self.kv_cache.num_blocks, weights.num_scratch_blocks, max_len, lookup_sizes, self.kernels.argmax)
        if weights.draft_shares_cache:
            return CacheSharingDrafter(ModelRunner(model, self.attention, self.eos_token_ids), *sizes)
        backend = make_attention_backend(draft.config, self.kv_cache.draft, self.kernels)
        return MirroringDrafter(ModelRunner(model, backend, self.eos_token_ids), *sizes)

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        return self.runner.execute(sched)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.kv_cache.num_host_blocks
