"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from kvmosaic.entrypoints.openai.errors import bad_request
from kvmosaic.entrypoints.openai.guided import guided_decoding
from kvmosaic.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from kvmosaic.entrypoints.openai.responses import respond
from kvmosaic.entrypoints.openai.sampling import build_sampling_params
from kvmosaic.entrypoints.openai.serving_common import ChoiceDelta, Generation, ServingContext
from kvmosaic.model.fim import fill_in_the_middle_prompt

MAX_PROMPTS = 64


class CompletionServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.ctx.check_model(body.model)
        prompts = _prompts(body.prompt)
        if body.suffix:
            prompts = [self._fill_in_the_middle(p, body.suffix) for p in prompts]
        # echo + logprobs scores the prompt too: the log-likelihood requests of evaluation harnesses
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        if body.prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, body.prompt_logprobs)
        params = build_sampling_params(body, self.ctx, body.max_tokens, body.logprobs, body.best_of,
                                       guided_decoding(body), prompt_logprobs)
        call_id = f"cmpl-{uuid.uuid4().hex}"
        gen = Generation(self.ctx, call_id, len(prompts), params.n,
                         with_prompt=bool(body.echo) or body.prompt_logprobs is not None)
        await gen.start(prompts, params, arrival)
        return await respond(gen, raw, body, _Responder(self.ctx, call_id, body))

    def _fill_in_the_middle(self, prompt: str | list[int], suffix: str) -> str:
        if not isinstance(prompt, str):
            raise bad_request("suffix needs text prompts, not token ids", "suffix")
        try:
            return fill_in_the_middle_prompt(self.ctx.tokenizer, prompt, suffix)
        except ValueError as exc:
            raise bad_request(str(exc), "suffix") from exc


class _Responder:
    """Builds completion bodies and chunks, keeping each choice's text offset for logprobs."""

    def __init__(self, ctx: ServingContext, call_id: str, body: CompletionRequest) -> None:
        self.ctx = ctx
        self.id = call_id
        self.created = int(time.time())
        self.with_logprobs = body.logprobs is not None
        self.echo = bool(body.echo)
        self.prompt_logprobs = body.prompt_logprobs
        self.text_offsets: dict[int, int] = {}

    def head(self) -> list[CompletionResponse]:
        return []

    def chunks(self, deltas: list[ChoiceDelta]) -> list[CompletionResponse]:
        return [self.chunk([d]) for d in deltas]

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self.chunk([], usage)

    def response(self, choices: list[ChoiceDelta], usage: UsageInfo) -> CompletionResponse:
        return self.chunk(choices, usage)

    def chunk(self, deltas: list[ChoiceDelta], usage: UsageInfo | None = None) -> CompletionResponse:
        choices = [CompletionChoice(index=d.index, text=self._echoed(d) + d.text, logprobs=self._logprobs(d),
                                    finish_reason=d.finish_reason, prompt_logprobs=self._prompt_logprobs(d))
                   for d in deltas]
        return CompletionResponse(id=self.id, created=self.created, model=self.ctx.model_name, choices=choices,
                                  usage=usage)

    def _logprobs(self, delta: ChoiceDelta) -> CompletionLogprobs | None:
        if not self.with_logprobs or delta.logprobs is None:
            return None
        out = CompletionLogprobs()
        offset = self.text_offsets.get(delta.index, 0)
        if self.echo and delta.prompt is not None and delta.prompt.logprobs is not None:
            for token_id, top in zip(delta.prompt.token_ids, delta.prompt.logprobs):
                text = self.ctx.token_text(token_id)
                out.tokens.append(text)
                out.token_logprobs.append(None if top is None else top[token_id])
                out.top_logprobs.append(None if top is None else self._top(top, token_id))
                out.text_offset.append(offset)
                offset += len(text)
        for token_id, top in zip(delta.token_ids, delta.logprobs):
            text = self.ctx.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(top[token_id])
            out.top_logprobs.append({self.ctx.token_text(t): lp for t, lp in top.items()})
            out.text_offset.append(offset)
            offset += len(text)
        self.text_offsets[delta.index] = offset
        return out

    def _top(self, top: dict[int, float], token_id: int) -> dict[str, float]:
        """The asked-for number of most likely tokens (the actual one comes on top of them)."""
        return {self.ctx.token_text(t): lp for t, lp in top.items()}

    def _echoed(self, delta: ChoiceDelta) -> str:
        return delta.prompt.text if self.echo and delta.prompt is not None else ""

    def _prompt_logprobs(self, delta: ChoiceDelta) -> list[dict[str, float] | None] | None:
        if self.prompt_logprobs is None or delta.prompt is None or delta.prompt.logprobs is None:
            return None
        return [None if top is None else {str(t): lp for t, lp in top.items()} for top in delta.prompt.logprobs]


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    prompts = [prompt] if isinstance(prompt[0], int) else list(prompt)
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    return prompts
