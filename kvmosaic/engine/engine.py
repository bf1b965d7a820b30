"""The engine core: add_request / abort / step. It owns the scheduler, the KV manager and the
output processor, and runs each step on an executor; it holds no tensors itself."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time

from kvmosaic.config import EngineConfig
from kvmosaic.core.block_allocator import BlockAllocator
from kvmosaic.core.kv_arrivals import ArrivedKV, KVArrivals
from kvmosaic.core.kv_cache_manager import KVCacheManager
from kvmosaic.core.scheduler import Scheduler
from kvmosaic.core.speculation.speculator import Speculator, build_speculator
from kvmosaic.engine.errors import RetryableStepError
from kvmosaic.engine.output_processor import OutputProcessor
from kvmosaic.engine.protocol import SERVING, ServingState
from kvmosaic.engine.request_checks import check_logit_bias, fit_max_tokens, tokenize_prompt
from kvmosaic.executor.base import Executor
from kvmosaic.outputs import ModelOutput, RequestOutput, SampledToken, SchedulerOutput
from kvmosaic.request import Request, RequestStatus
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.structured.grammar_guide import GuideFactory

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig | None = None, executor: Executor | None = None, *,
                 allocator: BlockAllocator | None = None,
                 kv_lock: contextlib.AbstractContextManager | None = None,
                 speculator: Speculator | None = None, arrivals: KVArrivals | None = None,
                 guides: GuideFactory | None = None) -> None:
        """``executor``: where steps run (default: a local worker built from ``config``);
        ``allocator``: blocks beyond the local pool; ``kv_lock``: held around scheduling and
        bookkeeping, not the forward pass (other threads may then lend this pool's blocks);
        ``speculator``: proposes tokens to verify (default: the one ``config.speculative`` asks for);
        ``arrivals``: where K/V of requests prefilled elsewhere land (``insert``);
        ``guides``: compiles guided-decoding constraints (default: llguidance over the model's tokenizer)."""
        if executor is None:
            from kvmosaic.executor.local import LocalExecutor  # the model stack loads only when needed

            executor = LocalExecutor(config if config is not None else EngineConfig())
        self.executor = executor
        self.config = executor.config
        self.model_config = executor.model_config
        self.tokenizer = executor.tokenizer
        cache = self.config.cache
        self.kv_manager = KVCacheManager(executor.num_blocks, cache.block_size, executor.num_host_blocks,
                                         cache.enable_prefix_caching, allocator)
        self.speculator = speculator if speculator is not None else build_speculator(self.config.speculative)
        self.arrivals = arrivals if arrivals is not None else KVArrivals(cache.block_size)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_manager, executor.eos_token_ids, self.speculator,
                                   self.arrivals)
        self.processor = OutputProcessor(self.tokenizer)
        self.guides = guides if guides is not None else GuideFactory(self.tokenizer, self.model_config.vocab_size)
        self._pending_outputs: list[RequestOutput] = []
        self._ids = itertools.count()
        self.kv_lock = kv_lock if kv_lock is not None else contextlib.nullcontext()
        logger.info("kvmosaic engine: %s", executor.describe())
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
        request, prompt_text = self.make_request(request_id, prompt, params, arrival_time)
        self.scheduler.add_request(request)
        self.processor.add_group(request, prompt_text)
        return request.request_id

    def make_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                     arrival_time: float | None = None) -> tuple[Request, str | None]:
        """The validated request ``add_request`` would queue, and the prompt's text; ValueError on bad input."""
        params = params if params is not None else SamplingParams()
        request_id = request_id if request_id is not None else self.next_request_id()
        if request_id in self.processor.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, token_ids = self._tokenize(prompt)
        params = self._fit_max_tokens(params, len(token_ids))
        check_logit_bias(params, self.model_config.vocab_size)
        guide = self.guides.start(params.guided_decoding, params.jump_forward)
        request = Request(request_id, token_ids, params, arrival_time if arrival_time is not None else time.monotonic(),
                          guide=guide)
        return request, prompt_text

    def insert(self, request_id: str, prompt: str | list[int], params: SamplingParams, first: SampledToken,
               kv: ArrivedKV | None = None, arrival_time: float | None = None) -> str:
        """Continue a request whose prompt ran elsewhere (JetStream's insert): ``first`` is the token
        sampled there, ``kv`` its prompt's K/V (None: recompute the prompt here). The first token's
        output comes from the next step(); ValueError on bad input, leaving the engine untouched."""
        if (params.best_of or 1) > 1:
            raise ValueError("a prefilled request continues one sequence: n and best_of must be 1")
        request, prompt_text = self.make_request(request_id, prompt, params, arrival_time)
        if kv is not None and kv.num_tokens != request.num_prompt_tokens:
            raise ValueError(f"the K/V of {kv.num_tokens} tokens does not match a prompt of "
                             f"{request.num_prompt_tokens}")
        request.append_output_token(first.token_id)
        if kv is not None:
            self.arrivals.offer(request.request_id, kv)
        self.scheduler.add_prefilled(request)
        self.processor.add_group(request, prompt_text)
        outputs, stopped, failed = self.processor.process([request], ModelOutput(sampled={request.request_id: first}))
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._pending_outputs += outputs
        self._pending_outputs += [self._fail_group(group_id, message) for group_id, message in failed.items()]
        return request.request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt, self.max_model_len)

    def _fit_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        params = fit_max_tokens(params, prompt_len, self.max_model_len)
        needed = prompt_len + params.max_tokens
        if params.use_beam_search:  # every beam may end up with its own blocks past the shared prompt
            needed = prompt_len + (params.best_of or 1) * (params.max_tokens + self.kv_manager.block_size)
        if not self.scheduler.can_ever_fit(needed):
            slots = self.kv_manager.num_reachable_blocks * self.kv_manager.block_size
            raise ValueError(
                f"request needs {needed} KV slots but the pool holds only {slots}; "
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
        started = time.perf_counter()
        try:
            model_out = self.executor.execute(sched_out)
        except RetryableStepError:
            # Nothing advanced: the requests run again in the next step.
            self._pending_outputs = outputs + self._pending_outputs
            raise
        except Exception as exc:  # noqa: BLE001  (one bad step fails its requests, not the engine)
            logger.exception("a step failed; its requests end with an error")
            with self.kv_lock:
                return outputs + self._fail_step(sched_out, exc)
        with self.kv_lock:
            updated = self.scheduler.update_from_output(sched_out, model_out, time.perf_counter() - started)
            step_outputs, stopped, failed = self.processor.process(updated, model_out)
            if stopped:
                self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
            step_outputs += [self._fail_group(group_id, message) for group_id, message in failed.items()]
            step_outputs += self.processor.finish_beams(self.scheduler.take_beam_results())
        return outputs + step_outputs

    def _fail_step(self, sched_out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """End every request the failed step touched (its blocks may hold half-written K/V)."""
        # Blocks of this step are indexed by hash already but hold no trustworthy K/V.
        self.kv_manager.reset_prefix_cache()
        seq_ids = [s.request_id for s in sched_out.scheduled] + list(sched_out.preempted_request_ids)
        groups = dict.fromkeys(g for seq in seq_ids if (g := self.processor.group_of(seq)) is not None)
        message = f"the engine failed while running the request: {type(exc).__name__}: {exc}"
        return [self._fail_group(group_id, message) for group_id in groups]

    def _fail_group(self, group_id: str, message: str) -> RequestOutput:
        self.scheduler.finish_requests(self.processor.sequence_ids(group_id), RequestStatus.FINISHED_ABORTED)
        return self.processor.finish_failed(group_id, message)

    def reset_prefix_cache(self) -> None:
        with self.kv_lock:
            self.kv_manager.reset_prefix_cache()

    def stats(self) -> dict:
        cache = self.kv_manager.prefix_cache_stats()
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_swapped": self.scheduler.num_swapped,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": self.kv_manager.num_blocks,
            "kv_blocks_used": self.kv_manager.num_used_blocks,
            "kv_blocks_free": self.kv_manager.num_free_blocks,
            "prefix_cache_queries": cache["queries"],
            "prefix_cache_hits": cache["hits"],
            "prefix_cache_hit_rate": cache["hit_rate"],
            **self._spec_stats(),
        }

    def serving_state(self) -> ServingState:
        return SERVING  # one process: serving as long as it runs

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        spec = self.speculator.stats
        return {
            "spec_num_drafts": spec.num_drafts,
            "spec_num_draft_tokens": spec.num_draft_tokens,
            "spec_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_mean_accepted_length": spec.mean_accepted_length,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()
