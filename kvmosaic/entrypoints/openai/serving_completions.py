"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from kvmosaic.entrypoints.openai.errors import bad_request
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

MAX_PROMPTS = 64


class CompletionServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.ctx.check_model(body.model)
        if body.echo:
            raise bad_request("echo is not supported", "echo")
        if body.suffix:
            raise bad_request("suffix is not supported", "suffix")
        prompts = _prompts(body.prompt)
        params = build_sampling_params(body, self.ctx, body.max_tokens, body.logprobs, body.best_of)
        call_id = f"cmpl-{uuid.uuid4().hex}"
        gen = Generation(self.ctx, call_id, len(prompts), params.n)
        await gen.start(prompts, params, arrival)
        return await respond(gen, raw, body, _Responder(self.ctx, call_id, body))


class _Responder:
    """Builds completion bodies and chunks, keeping each choice's text offset for logprobs."""

    def __init__(self, ctx: ServingContext, call_id: str, body: CompletionRequest) -> None:
        self.ctx = ctx
        self.id = call_id
        self.created = int(time.time())
        self.with_logprobs = body.logprobs is not None
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
        choices = [CompletionChoice(index=d.index, text=d.text, logprobs=self._logprobs(d),
                                    finish_reason=d.finish_reason) for d in deltas]
        return CompletionResponse(id=self.id, created=self.created, model=self.ctx.model_name, choices=choices,
                                  usage=usage)

    def _logprobs(self, delta: ChoiceDelta) -> CompletionLogprobs | None:
        if not self.with_logprobs or delta.logprobs is None:
            return None
        out = CompletionLogprobs()
        offset = self.text_offsets.get(delta.index, 0)
        for token_id, top in zip(delta.token_ids, delta.logprobs):
            text = self.ctx.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(top[token_id])
            out.top_logprobs.append({self.ctx.token_text(t): lp for t, lp in top.items()})
            out.text_offset.append(offset)
            offset += len(text)
        self.text_offsets[delta.index] = offset
        return out


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    prompts = [prompt] if isinstance(prompt[0], int) else list(prompt)
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    return prompts
