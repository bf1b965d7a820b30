"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import time
import uuid

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from kvmosaic.entrypoints.openai import tool_calls
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
    DeltaToolCall,
    FunctionCall,
    TokenLogprob,
    ToolCallInfo,
    TopLogprob,
    UsageInfo,
)
from kvmosaic.entrypoints.openai.responses import respond
from kvmosaic.entrypoints.openai.sampling import build_sampling_params
from kvmosaic.entrypoints.openai.serving_common import ChoiceDelta, Generation, ServingContext
from kvmosaic.structured import GuidedDecoding

MAX_TOP_LOGPROBS = 20
_ROLE_ALIASES = {"developer": "system"}


class ChatServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.ctx.check_model(body.model)
        _check_unsupported(body)
        # Python work that grows with the request (schemas, template, tokenizer) runs in a worker
        # thread, so the event loop goes on serving every other client meanwhile.
        functions, prompt_ids, constraint = await asyncio.to_thread(self._prepare, body)
        params = build_sampling_params(body, self.ctx, body.max_completion_tokens or body.max_tokens,
                                       _logprobs(body), guided=constraint)
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = Generation(self.ctx, call_id, 1, params.n)
        await gen.start([prompt_ids], params, arrival)
        tool_names = {f["name"] for f in functions}
        return await respond(gen, raw, body, _Responder(self.ctx, call_id, params.n, params.logprobs, tool_names))

    def _prepare(self, body: ChatCompletionRequest) -> tuple[list[dict], list[int], GuidedDecoding | None]:
        """(the functions offered, the prompt's token ids, the output constraint), or an ApiError."""
        functions = _functions(body)
        prompt_ids = encode_messages(self.ctx, body.messages, body.add_generation_prompt, functions)
        guided = guided_decoding(body, body.response_format)
        try:
            forced_calls = tool_calls.call_grammar(functions, body.tool_choice) if functions else None
        except ValueError as exc:  # the tools' schemas together make a grammar over the size bound
            raise bad_request(str(exc), "tools") from exc
        if forced_calls is not None and guided is not None:
            raise bad_request("tool_choice 'required' or a named function cannot be combined with another "
                              "output constraint", "tool_choice")
        return functions, prompt_ids, forced_calls or guided


def _functions(body: ChatCompletionRequest) -> list[dict]:
    """The function specs the model is offered (none for tool_choice "none")."""
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return []
    try:
        functions = tool_calls.check_tools(body.tools, body.tool_choice)
    except ValueError as exc:
        raise bad_request(str(exc), "tools") from exc
    return [] if body.tool_choice == "none" else functions


async def encode_messages_off_loop(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool,
                                   functions: list[dict] | None = None) -> list[int]:
    """``encode_messages`` in a worker thread: a long conversation takes its template and tokenizer
    time there, while the event loop goes on serving every other request."""
    return await asyncio.to_thread(encode_messages, ctx, messages, add_generation_prompt, functions)


def encode_messages(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool,
                    functions: list[dict] | None = None) -> list[int]:
    """The prompt's token ids: messages rendered by the model's chat template (with the functions
    offered, if any); a 400 if they cannot be."""
    try:
        flat = [_flatten(i, m) for i, m in enumerate(messages)]
        tools = None
        if functions and ctx.tokenizer.chat_template_takes_tools:
            tools = [{"type": "function", "function": f} for f in functions]
        elif functions:
            flat = tool_calls.with_tool_prompt(flat, functions)
        return ctx.chat_encoder.encode(flat, add_generation_prompt, tools)
    except (ValueError, jinja2.TemplateError) as exc:
        raise bad_request(str(exc), "messages") from exc


def _check_unsupported(body: ChatCompletionRequest) -> None:
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
    if message.tool_calls:  # the calls an assistant made, as it wrote them
        try:
            calls = tool_calls.render_calls(message.tool_calls)
        except ValueError as exc:
            raise bad_request(f"messages[{index}].{exc}", "messages") from exc
        content = f"{content}\n{calls}" if content else calls
    if content is None:
        raise bad_request(f"messages[{index}] has no content", "messages")
    return {"role": _ROLE_ALIASES.get(message.role, message.role), "content": content}


class _Responder:
    def __init__(self, ctx: ServingContext, call_id: str, n: int, top_logprobs: int | None,
                 tool_names: set[str] | frozenset[str] = frozenset()) -> None:
        """``tool_names``: the functions offered; calls to them are parsed out of the text."""
        self.ctx = ctx
        self.id = call_id
        self.created = int(time.time())
        self.n = n
        self.top_logprobs = top_logprobs
        self.tool_names = set(tool_names)
        self.streams: dict[int, tool_calls.ToolCallStream] = {}

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.ctx.model_name, choices=choices,
                                   usage=usage)

    def head(self) -> list[ChatCompletionChunk]:
        """One chunk per choice announcing the assistant role, as OpenAI streams start."""
        return [self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(self.n)]

    def chunks(self, deltas: list[ChoiceDelta]) -> list[ChatCompletionChunk]:
        return [self._chunk([self._stream_choice(d)]) for d in deltas]

    def _stream_choice(self, d: ChoiceDelta) -> ChatStreamChoice:
        if not self.tool_names:
            return ChatStreamChoice(index=d.index, delta=DeltaMessage(content=d.text or None),
                                    logprobs=self._logprobs(d), finish_reason=d.finish_reason)
        stream = self.streams.setdefault(d.index, tool_calls.ToolCallStream(self.tool_names))
        first = stream.num_calls
        content, calls = stream.feed(d.text, final=d.finish_reason is not None)
        deltas = [DeltaToolCall(index=first + i, id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                  for i, c in enumerate(calls)]
        finish = "tool_calls" if d.finish_reason == "stop" and stream.num_calls else d.finish_reason
        return ChatStreamChoice(index=d.index, delta=DeltaMessage(content=content or None, tool_calls=deltas or None),
                                logprobs=self._logprobs(d), finish_reason=finish)

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, choices: list[ChoiceDelta], usage: UsageInfo) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.ctx.model_name, usage=usage,
            choices=[self._choice(d) for d in choices],
        )

    def _choice(self, d: ChoiceDelta) -> ChatChoice:
        content, calls = tool_calls.parse_calls(d.text, self.tool_names) if self.tool_names else (d.text, [])
        message = AssistantMessage(content=content or (None if calls else ""), tool_calls=[
            ToolCallInfo(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None)
        finish = "tool_calls" if calls and d.finish_reason == "stop" else d.finish_reason
        return ChatChoice(index=d.index, message=message, logprobs=self._logprobs(d), finish_reason=finish)

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
