"""POST /tokenize and /detokenize (vLLM's shapes): the model's own tokenizer, and its chat template."""

from __future__ import annotations

import asyncio

from kvmosaic.entrypoints.openai.errors import bad_request
from kvmosaic.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvmosaic.entrypoints.openai.serving_chat import encode_messages_off_loop
from kvmosaic.entrypoints.openai.serving_common import ServingContext


class TokenServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            tokens = await encode_messages_off_loop(self.ctx, body.messages, body.add_generation_prompt)
        else:  # a long prompt is seconds of tokenizer work: a worker thread does it, not the event loop
            tokens = await asyncio.to_thread(self.ctx.tokenizer.encode, body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=self.ctx.max_model_len, tokens=tokens)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.ctx.check_model(body.model)
        return await asyncio.to_thread(self._detokenize, body.tokens)  # as long as the body allows: off the loop

    def _detokenize(self, tokens: list[int]) -> DetokenizeResponse:
        if any(not 0 <= t < self.ctx.vocab_size for t in tokens):
            raise bad_request(f"tokens must be token ids in [0, {self.ctx.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=self.ctx.tokenizer.decode(tokens, skip_special_tokens=False))
