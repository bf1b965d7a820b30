"""Offline batch API shaped like vLLM's ``LLM``."""

from __future__ import annotations

import os
from collections.abc import Sequence

from tqdm.auto import tqdm

from kvmosaic.config import (
    CacheConfig,
    DisaggConfig,
    DistributedConfig,
    EngineConfig,
    RestartPolicy,
    SchedulerConfig,
)
from kvmosaic.engine.factory import build_engine
from kvmosaic.engine.protocol import EngineClient
from kvmosaic.outputs import RequestOutput
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.spec.config import SpeculativeConfig

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        kv_cache_memory: int | str = "auto",
        memory_utilization: float = 0.5,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 128,
        max_model_len: int = 8192,
        preemption_mode: str = "recompute",
        swap_space: int | str = "1GiB",
        long_prefill_token_threshold: int = 0,
        num_scheduler_steps: int = 1,
        num_blocks: int | None = None,
        num_host_blocks: int | None = None,
        num_threads: int | None = None,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        kv_thresholds: str | None = None,
        kv_cache_prefault: bool = False,
        instances: int = 1,
        ray_address: str | None = None,
        enable_borrowing: bool = True,
        cluster_secret_file: str | None = None,
        prefill_workers: int = 0,
        decode_workers: int = 0,
        kv_transfer_dtype: str = "auto",
        max_worker_restarts: int = 3,
        quantization: str | None = "auto",
        speculative: SpeculativeConfig | dict | str | None = None,
        model_loader=None,
    ) -> None:
        """``instances > 1`` (or a ``ray_address``) runs that many engine instances as Ray actors that
        lend each other KV blocks (``kvmosaic.distributed``); each gets the full ``kv_cache_memory``, and
        their data plane admits only holders of the cluster secret (``cluster_secret_file``, else
        ``KVMOSAIC_CLUSTER_SECRET``, else a new one; docs/security.md).
        ``kv_cache_memory="auto"`` sizes the pool from a profiling run (``memory_utilization`` of the
        RAM still available); ``kv_cache_prefault`` makes the whole pool resident at start (as vLLM and
        llama.cpp reserve theirs) instead of page by page as blocks are first written. ``quantization``:
        the weight format (``auto``: a GGUF's Q8_0 / Q4_x / Q6_K matrices run natively, an HF directory
        stays float; None: every weight dequantized to ``dtype``;
        ``q8_0``, ``q4_0``, ``q4_1``, ``q4_k``, ``q6_k``: quantized at load). ``speculative``: speculative
        decoding, e.g.
        ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}``
        (``SpeculativeConfig``; a bad one raises ``SpeculativeConfigError``). ``num_scheduler_steps``: forward
        passes a decode-only step runs, each sequence feeding its sampled token back, before the scheduler
        runs again (vLLM's multi-step scheduling: less Python per token, output arrives in runs).
        ``model_loader(path, dtype)`` reads the weights of an in-process engine instead (its own weight
        format). ``prefill_workers`` / ``decode_workers`` > 0: disaggregated prefill and decode, that many
        workers of each as Ray actors (``kvmosaic.disagg``; the prompt's K/V moves from a prefill to a
        decode worker, as int8 records of a float cache with ``kv_transfer_dtype="int8"``).
        ``max_worker_restarts``: how often an instance or worker actor that died or hung is replaced (per slot,
        within ``RestartPolicy.window``; 0: a lost one stays lost)."""
        distributed = instances > 1 or (bool(ray_address) and not (prefill_workers or decode_workers))
        if distributed and num_threads is None:  # the instances share the cores
            num_threads = max(1, (os.cpu_count() or 1) // instances)
        config = EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            seed=seed,
            num_threads=num_threads,
            cache=CacheConfig(
                block_size=block_size, kv_cache_memory=kv_cache_memory, memory_utilization=memory_utilization,
                swap_space=swap_space,
                enable_prefix_caching=enable_prefix_caching, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                kv_cache_dtype=kv_cache_dtype, kv_thresholds=kv_thresholds, prefault=kv_cache_prefault,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, preemption_mode=preemption_mode,
                long_prefill_token_threshold=long_prefill_token_threshold,
                num_scheduler_steps=num_scheduler_steps,
            ),
            speculative=SpeculativeConfig.parse(speculative),
        )
        restart = RestartPolicy(max_restarts=max_worker_restarts)
        dist = DistributedConfig(num_instances=instances, ray_address=ray_address, enable_borrowing=enable_borrowing,
                                 cluster_secret_file=cluster_secret_file, restart=restart) if distributed else None
        disagg = (DisaggConfig(prefill_workers=max(1, prefill_workers), decode_workers=max(1, decode_workers),
                               ray_address=ray_address, kv_transfer_dtype=kv_transfer_dtype, restart=restart)
                  if prefill_workers or decode_workers else None)
        if disagg is not None:
            dist = None  # ray_address goes to the workers
        self.engine: EngineClient = build_engine(config, dist, model_loader, disagg)

    def shutdown(self) -> None:
        """Stop the instance actors of a cluster (a no-op for one in-process engine)."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        request_ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                request_ids.append(self.engine.add_request(None, prompt, sp))
        except Exception:
            self._abort_all(request_ids)  # a bad prompt rejects the whole call, leaving nothing queued
            raise
        return self._run(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        num_return: int | None = None,
        ignore_eos: bool = False,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Beam search with transformers' semantics: each output holds the best ``num_return``
        (default: all ``beam_width``) hypotheses, best first, with their scores
        (``CompletionOutput.score``: cumulative logprob / length ** length_penalty)."""
        params = SamplingParams(use_beam_search=True, best_of=beam_width, n=num_return or beam_width,
                                max_tokens=max_tokens, length_penalty=length_penalty,
                                early_stopping=early_stopping, ignore_eos=ignore_eos)
        return self.generate(prompts, params, use_tqdm)

    def _abort_all(self, request_ids) -> None:
        for rid in request_ids:
            self.engine.abort(rid, emit_output=False)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_lists = [self.encode_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(token_lists, sampling_params, use_tqdm)

    def encode_chat(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        """One conversation's prompt token ids through the model's chat template."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self._abort_all(pending)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]


def _params_per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params
