"""Offline batch API shaped like vLLM's ``LLM``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvmosaic.engine.factory import build_engine
from kvmosaic.engine.protocol import EngineClient
from kvmosaic.engine_args import EngineArgs
from kvmosaic.options import check_keywords, keyword_parameters
from kvmosaic.outputs import RequestOutput
from kvmosaic.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    def __init__(self, model: str | None = None, *, model_loader: Callable | None = None, **options: Any) -> None:
        """An engine for ``model`` with ``options``: exactly the fields of ``EngineArgs``, where each is
        described (``kvmosaic serve --help`` lists the same options as flags); an unknown one is a
        TypeError. ``model_loader(path, dtype)`` reads the weights of an in-process engine instead of
        ``load_model`` (its own weight format).

        ``instances > 1`` runs that many engine instances as Ray actors that lend each other KV blocks
        (``kvmosaic.distributed``); ``prefill_workers`` / ``decode_workers`` > 0 disaggregate prefill and
        decode (``kvmosaic.disagg``)."""
        check_keywords(EngineArgs, options, "LLM()", others=["model_loader"])
        self.engine_args = EngineArgs(model=model, **options)
        configs = self.engine_args.create_engine_configs()
        self.engine: EngineClient = build_engine(configs.engine, configs.distributed, model_loader, configs.disagg)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, model_loader: Callable | None = None) -> LLM:
        return cls(model_loader=model_loader, **args.as_kwargs())

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


def _signature() -> inspect.Signature:
    """``LLM(model=None, *, <every EngineArgs option>, model_loader=None)``, for help() and editors."""
    options = {p.name: p for p in keyword_parameters(EngineArgs)}
    model = options.pop("model").replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
    loader = inspect.Parameter("model_loader", inspect.Parameter.KEYWORD_ONLY, default=None)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([this, model, *options.values(), loader], return_annotation=None)


LLM.__init__.__signature__ = _signature()
