"""What completions and chat share: the serving context and ``Generation``, the engine requests
of one HTTP call, turned into per-choice deltas as tokens arrive."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvmosaic.engine.async_engine import AsyncEngine
from kvmosaic.engine.errors import EngineUnavailableError
from kvmosaic.engine.output_sink import (
    EngineDeadError,
    OutputSink,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
    ServerDrainingError,
)
from kvmosaic.entrypoints.openai.chat_prompt import ChatPromptEncoder
from kvmosaic.entrypoints.openai.errors import ApiError, bad_request, param_named_in
from kvmosaic.entrypoints.openai.protocol import UsageInfo
from kvmosaic.model.tokenizer import Tokenizer
from kvmosaic.outputs import CompletionOutput, RequestOutput
from kvmosaic.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServingContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    chat_encoder: ChatPromptEncoder
    model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    max_n: int = 16
    token_text_cache: dict[int, str] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")

    def token_text(self, token_id: int) -> str:
        text = self.token_text_cache.get(token_id)
        if text is None:
            text = self.token_text_cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


# ---------------------------------------------------------------- one call's engine requests
@dataclass(slots=True)
class PromptEcho:
    """The prompt as a choice's first delta carries it (echo, prompt logprobs)."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    prompt: PromptEcho | None = None  # on a choice's first delta, when the call echoes or scores the prompt


@dataclass(slots=True)
class _Sent:
    chars: int = 0
    tokens: int = 0
    finished: bool = False
    prompt: bool = False  # the prompt went out with an earlier delta


class Generation:
    """The engine requests of one HTTP call (one per prompt, each with ``n`` choices)."""

    def __init__(self, ctx: ServingContext, call_id: str, num_prompts: int, n: int, with_prompt: bool = False) -> None:
        """``with_prompt``: each choice's first delta carries its prompt (``ChoiceDelta.prompt``)."""
        self._engine = ctx.engine
        self._tokenizer = ctx.tokenizer
        self._with_prompt = with_prompt
        self.request_ids = [call_id if num_prompts == 1 else f"{call_id}-{i}" for i in range(num_prompts)]
        self._prompt_index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._n = n
        self._sink = OutputSink()
        self._sent: dict[int, _Sent] = {}
        self._live: set[str] = set()
        self._prompt_tokens: dict[str, int] = {}

    async def start(self, prompts: list[str | list[int]], params: SamplingParams, arrival_time: float) -> None:
        """Submit every prompt; on any refusal abort the ones already submitted and raise an ApiError."""
        self._live.update(self.request_ids)
        submissions = [self._engine.add_request(rid, prompt, params, self._sink, arrival_time)
                       for rid, prompt in zip(self.request_ids, prompts, strict=True)]
        try:  # all at once: the engine accepts them in one loop iteration
            results = await asyncio.gather(*submissions, return_exceptions=True)
        except BaseException:
            self.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort()  # aborting a request the engine refused is a no-op
            raise _api_error(errors[0]) from errors[0]

    def abort(self) -> None:
        """Abort whatever is still running (client gone, error); a no-op once all finished."""
        for rid in self._live:
            self._engine.abort(rid)
        self._live.clear()

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """What each choice gained since the last yield, until every request finished."""
        while self._live:
            batch: list[ChoiceDelta] = []
            for rid, item in (await self._sink.get()).items():
                if isinstance(item, BaseException):
                    self._live.discard(rid)
                    raise item
                batch += self._new_deltas(rid, item)
            if batch:
                yield batch

    async def collect(self) -> list[ChoiceDelta]:
        """Every choice's full result, in index order."""
        merged: dict[int, ChoiceDelta] = {}
        async for batch in self.deltas():
            for d in batch:
                acc = merged.setdefault(d.index, ChoiceDelta(d.index, "", [], [] if d.logprobs is not None else None,
                                                             prompt=d.prompt))
                acc.text += d.text
                acc.token_ids += d.token_ids
                if d.logprobs is not None:
                    acc.logprobs += d.logprobs
                acc.finish_reason = d.finish_reason or acc.finish_reason
        return [merged[i] for i in sorted(merged)]

    def usage(self) -> UsageInfo:
        prompt = sum(self._prompt_tokens.values())
        completion = sum(s.tokens for s in self._sent.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def _new_deltas(self, rid: str, output: RequestOutput) -> list[ChoiceDelta]:
        self._prompt_tokens[rid] = len(output.prompt_token_ids)
        if output.finished:
            self._live.discard(rid)
        base = self._prompt_index[rid] * self._n
        deltas = [d for c in output.outputs if (d := self._delta(base + c.index, c)) is not None]
        for d in deltas:
            if self._with_prompt and not self._sent[d.index].prompt:
                self._sent[d.index].prompt = True
                d.prompt = self._echo(output)
        return deltas

    def _echo(self, output: RequestOutput) -> PromptEcho:
        text = output.prompt if output.prompt is not None else self._tokenizer.decode(output.prompt_token_ids)
        return PromptEcho(text, list(output.prompt_token_ids), output.prompt_logprobs)

    def _delta(self, index: int, completion: CompletionOutput) -> ChoiceDelta | None:
        sent = self._sent.setdefault(index, _Sent())
        text = completion.text[sent.chars :]
        finish = completion.finish_reason if completion.finished and not sent.finished else None
        if not text and finish is None:
            return None  # tokens that add no text yet (an incomplete UTF-8 character) wait for the next ones
        tokens = completion.token_ids[sent.tokens :]
        logprobs = completion.logprobs[sent.tokens :] if completion.logprobs is not None else None
        sent.chars, sent.tokens, sent.finished = len(completion.text), len(completion.token_ids), finish is not None
        return ChoiceDelta(index, text, tokens, logprobs, finish)


# What clients read when the engine or a worker fails: fixed text, because the exception's own text
# can carry worker process ids, node addresses and Ray namespaces; those go to the server log instead.
WORKER_FAILED = "the server failed while running the request; retry it"
ENGINE_STOPPED = "the engine is not running; retry the request later"
NO_WORKER = "no worker can take the request now; retry it later"
ENGINE_FAILED = "the engine failed; the details are in the server log"  # /health, after the loop died


def _api_error(exc: BaseException) -> BaseException:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValueError):
        return bad_request(str(exc), param_named_in(str(exc)) or "prompt")
    if isinstance(exc, QueueFullError):
        return ApiError(503, f"the server is overloaded: {exc}", code="queue_full")
    if isinstance(exc, ServerDrainingError):
        return ApiError(503, str(exc), code="unavailable")
    if isinstance(exc, EngineDeadError):
        return _withheld(503, ENGINE_STOPPED, exc, "unavailable")
    if isinstance(exc, EngineUnavailableError):  # a server fault
        return _withheld(503, NO_WORKER, exc, "unavailable")
    if isinstance(exc, RequestFailedError):
        return _withheld(500, WORKER_FAILED, exc, "engine_error")
    return exc


def engine_error(exc: BaseException) -> ApiError:
    """The error a request gets when the engine drops it mid-way (shutdown deadline, engine failure)."""
    if isinstance(exc, RequestAbortedError):  # the shutdown deadline: our own text, nothing to hide
        return ApiError(503, str(exc), code="aborted")
    if isinstance(exc, EngineDeadError):
        return _withheld(503, ENGINE_STOPPED, exc, "aborted")
    if isinstance(exc, RequestFailedError):  # other requests go on
        return _withheld(500, WORKER_FAILED, exc, "engine_error")
    logger.error("request failed", exc_info=exc)
    return ApiError(500, f"internal server error: {type(exc).__name__}")


def _withheld(status: int, message: str, exc: BaseException, code: str) -> ApiError:
    """An error with fixed client text; the exception's details are logged."""
    logger.warning("a request ended with %d (%s): %s: %s", status, code, type(exc).__name__, exc)
    return ApiError(status, message, code=code)
