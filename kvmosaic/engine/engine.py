"""The engine core: add_request / abort / step. It owns the scheduler, the KV
manager and the model runner, and holds no tensors itself."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import time

import torch

from kvmosaic.config import EngineConfig
from kvmosaic.core.kv_cache_manager import KVCacheManager
from kvmosaic.core.scheduler import Scheduler
from kvmosaic.engine.output_processor import OutputProcessor
from kvmosaic.model.llama import LlamaForCausalLM
from kvmosaic.model.loader import load_model
from kvmosaic.outputs import RequestOutput
from kvmosaic.quant import thresholds as kv_thresholds
from kvmosaic.request import Request, RequestStatus
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.worker.kv_cache import KVCache
from kvmosaic.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config.model, config.torch_dtype)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        sched_cfg = config.scheduler
        sched_cfg.max_model_len = min(sched_cfg.max_model_len, self.model_config.max_position_embeddings)
        model = LlamaForCausalLM(loaded.config, loaded.weights, max_positions=sched_cfg.max_model_len)
        model.eval()
        thresholds = None
        if config.cache.kv_cache_dtype == "oaken":
            identity = kv_thresholds.ModelIdentity.of(loaded.config, loaded.weights)
            thresholds = kv_thresholds.for_model(config.cache.kv_thresholds, identity, config.model is None)
        self.kv_cache = KVCache(loaded.config, config.cache, config.torch_dtype, thresholds)
        self.kv_manager = KVCacheManager(
            self.kv_cache.num_blocks, config.cache.block_size, self.kv_cache.num_host_blocks,
            config.cache.enable_prefix_caching,
        )
        eos = self.tokenizer.eos_token_ids or loaded.config.eos_token_ids
        self.scheduler = Scheduler(sched_cfg, self.kv_manager, tuple(eos))
        self.runner = ModelRunner(model, self.kv_cache, tuple(eos))
        self.processor = OutputProcessor(self.tokenizer)
        self._pending_outputs: list[RequestOutput] = []
        self._ids = itertools.count()
        # Held around scheduling and bookkeeping, not the forward pass: kvmosaic.distributed sets a real
        # lock so other instances can borrow this pool's blocks while the model runs.
        self.kv_lock: contextlib.AbstractContextManager = contextlib.nullcontext()
        logger.info("kvmosaic engine: %s, %d KV blocks of %d tokens (%d host blocks), KV cache %s (%.2f bits/value)",
                    loaded.config.name or loaded.config.architecture, self.kv_cache.num_blocks,
                    config.cache.block_size, self.kv_cache.num_host_blocks, config.cache.kv_cache_dtype,
                    self.kv_cache.bits_per_value)
        # Everything built so far (weights, tokenizer tables, modules) lives as long as the engine:
        # keep it out of the cyclic collector's full passes, which otherwise stall random steps.
        gc.collect()
        gc.freeze()

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Validate and queue a request; raises ValueError on bad input, leaving the engine untouched."""
        params = params if params is not None else SamplingParams()
        request_id = request_id if request_id is not None else self.next_request_id()
        if request_id in self.processor.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, token_ids = self._tokenize(prompt)
        params = self._fit_max_tokens(params, len(token_ids))
        request = Request(request_id, token_ids, params, arrival_time if arrival_time is not None else time.monotonic())
        self.scheduler.add_request(request)
        self.processor.add_group(request, prompt_text)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, token_ids

    def _fit_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ValueError(f"prompt has {prompt_len} tokens; the context length is {limit}")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=limit - prompt_len)
        if prompt_len + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds the context length {limit}"
            )
        if not self.scheduler.can_ever_fit(prompt_len + params.max_tokens):
            slots = self.kv_manager.num_reachable_blocks * self.kv_manager.block_size
            raise ValueError(
                f"request needs {prompt_len + params.max_tokens} KV slots but the pool holds only {slots}; "
                "raise kv_cache_memory or lower max_tokens"
            )
        return params

    def abort(self, request_id: str, emit_output: bool = True) -> None:
        """Stop a request and free its blocks; its final output (reason "abort") comes from the next step()."""
        seq_ids = self.processor.sequence_ids(request_id)
        if not seq_ids:
            return
        self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
        out = self.processor.finish_aborted(request_id)
        if out is not None and emit_output:
            self._pending_outputs.append(out)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        with self.kv_lock:
            sched_out = self.scheduler.schedule()
        try:
            model_out = self.runner.execute(sched_out)
        except BaseException:
            # Nothing advanced: a caller that recovers (a lost KV holder) just steps again.
            self._pending_outputs = outputs + self._pending_outputs
            raise
        with self.kv_lock:
            updated = self.scheduler.update_from_output(sched_out, model_out)
            step_outputs, stopped = self.processor.process(updated, model_out)
            if stopped:
                self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs + step_outputs

    def stats(self) -> dict:
        cache = self.kv_manager.prefix_cache_stats()
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_swapped": self.scheduler.num_swapped,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": self.kv_manager.num_blocks,
            "kv_blocks_used": self.kv_manager.num_used_blocks,
            "prefix_cache_queries": cache["queries"],
            "prefix_cache_hits": cache["hits"],
            "prefix_cache_hit_rate": cache["hit_rate"],
        }
