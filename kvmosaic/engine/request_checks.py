"""Checks of a request's prompt and length that every engine front makes before queueing it."""

from __future__ import annotations

import dataclasses

from kvmosaic.model.tokenizer import Tokenizer
from kvmosaic.sampling_params import SamplingParams


def tokenize_prompt(tokenizer: Tokenizer, vocab_size: int, prompt: str | list[int],
                    max_len: int | None = None) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids); ValueError for an empty or invalid prompt, or for a
    text too long to fit ``max_len`` tokens whatever its tokenization (refused without tokenizing it)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if max_len is not None and len(prompt) > max_len * tokenizer.max_token_chars:
            raise ValueError(f"prompt has more than {max_len} tokens ({len(prompt)} characters, at most "
                             f"{tokenizer.max_token_chars} a token); the context length is {max_len}")
        try:
            prompt.encode("utf-8")
            return prompt, tokenizer.encode(prompt)
        except Exception as exc:  # noqa: BLE001  (a lone surrogate, or anything the tokenizer rejects)
            raise ValueError(f"prompt is not valid text: {exc}") from exc
    token_ids = list(prompt)
    if not token_ids:
        raise ValueError("prompt must not be empty")
    if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    return None, token_ids


def fit_max_tokens(params: SamplingParams, prompt_len: int, limit: int) -> SamplingParams:
    """``params`` with max_tokens set (None: up to the context length ``limit``); ValueError if the
    prompt and its tokens do not fit the context."""
    if prompt_len >= limit:
        raise ValueError(f"prompt has {prompt_len} tokens; the context length is {limit}")
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=limit - prompt_len)
    if prompt_len + params.max_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds the context length {limit}"
        )
    return params


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """ValueError for a logit_bias key that is not a token id of the model."""
    for token_id in params.logit_bias or {}:
        if token_id >= vocab_size:
            raise ValueError(f"logit_bias has token id {token_id}, outside the vocabulary [0, {vocab_size})")
