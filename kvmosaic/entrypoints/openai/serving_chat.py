"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from kvmosaic.entrypoints.openai.errors import bad_request
from kvmosaic.entrypoints.openai.guided import guided_decoding
from kvmosaic.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from kvmosaic.entrypoints.openai.responses import respond
from kvmosaic.entrypoints.openai.sampling import build_sampling_params
from kvmosaic.entrypoints.openai.serving_common import ChoiceDelta, Generation, ServingContext

MAX_TOP_LOGPROBS = 20
_ROLE_ALIASES = {"developer": "system"}


class ChatServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.ctx.check_model(body.model)
        _check_unsupported(body)
        prompt_ids = self._encode(body)
        params = build_sampling_params(body, self.ctx, body.max_completion_tokens or body.max_tokens,
                                       _logprobs(body), guided=guided_decoding(body, body.response_format))
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = Generation(self.ctx, call_id, 1, params.n)
        await gen.start([prompt_ids], params, arrival)
        return await respond(gen, raw, body, _Responder(self.ctx, call_id, params.n, params.logprobs))

    def _encode(self, body: ChatCompletionRequest) -> list[int]:
        return encode_messages(self.ctx, body.messages, body.add_generation_prompt)


def encode_messages(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """The prompt's token ids: messages rendered by the model's chat template; a 400 if they cannot be."""
    flat = [_flatten(i, m) for i, m in enumerate(messages)]
    try:
        return ctx.chat_encoder.encode(flat, add_generation_prompt)
    except (ValueError, jinja2.TemplateError) as exc:
        raise bad_request(str(exc), "messages") from exc


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise bad_request("tools are not supported", "tools")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")


def _logprobs(body: ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None


def _flatten(index: int, message: ChatMessage) -> dict:
    """The template's view of a message: a role and one string of content."""
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise bad_request(f"messages[{index}]: only text content parts are supported", "messages")
        content = "".join(part.text for part in content)
    if content is None:
        raise bad_request(f"messages[{index}] has no content", "messages")
    return {"role": _ROLE_ALIASES.get(message.role, message.role), "content": content}


class _Responder:
    def __init__(self, ctx: ServingContext, call_id: str, n: int, top_logprobs: int | None) -> None:
        self.ctx = ctx
        self.id = call_id
        self.created = int(time.time())
        self.n = n
        self.top_logprobs = top_logprobs

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.ctx.model_name, choices=choices,
                                   usage=usage)

    def head(self) -> list[ChatCompletionChunk]:
        """One chunk per choice announcing the assistant role, as OpenAI streams start."""
        return [self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(self.n)]

    def chunks(self, deltas: list[ChoiceDelta]) -> list[ChatCompletionChunk]:
        return [self._chunk([ChatStreamChoice(index=d.index, delta=DeltaMessage(content=d.text or None),
                                              logprobs=self._logprobs(d), finish_reason=d.finish_reason)])
                for d in deltas]

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, choices: list[ChoiceDelta], usage: UsageInfo) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.ctx.model_name, usage=usage,
            choices=[ChatChoice(index=d.index, message=AssistantMessage(content=d.text), logprobs=self._logprobs(d),
                                finish_reason=d.finish_reason) for d in choices],
        )

    def _logprobs(self, delta: ChoiceDelta) -> ChatLogprobs | None:
        if self.top_logprobs is None or delta.logprobs is None:
            return None
        content = []
        for token_id, top in zip(delta.token_ids, delta.logprobs):
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
            content.append(TokenLogprob(**self._entry(token_id, top[token_id]).model_dump(),
                                        top_logprobs=[self._entry(t, lp) for t, lp in ranked]))
        return ChatLogprobs(content=content)

    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.ctx.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
