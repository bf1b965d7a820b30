"""API request fields -> SamplingParams, with every bad value a 400 that names its field."""

from __future__ import annotations

import math
import re

from kvmosaic.entrypoints.openai.errors import bad_request, param_named_in
from kvmosaic.entrypoints.openai.protocol import SamplingRequest
from kvmosaic.entrypoints.openai.serving_common import ServingContext
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.structured import GuidedDecoding

MAX_LOGPROBS = 20  # SamplingParams' bound, as vLLM's default max_logprobs
MAX_LOGIT_BIAS = 1024  # OpenAI allows 300; every decode step adds each entry in Python, for every request
MAX_STOP_TOKEN_IDS = 1024  # each decode step looks them up (and builds a set of them) per request
MAX_STOP_STRINGS = 8  # OpenAI allows 4; a few more for harnesses that list several terminators
MAX_STOP_CHARS = 512  # every streamed choice holds back up to this much text while a stop may be forming
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # ASCII digits only: "²" is a digit to str.isdigit, not to int()
_SEED_RANGE = (-(2**63), 2**63)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def build_sampling_params(req: SamplingRequest, ctx: ServingContext, max_tokens: int | None,
                          logprobs: int | None, best_of: int | None = None,
                          guided: GuidedDecoding | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """Map API fields to SamplingParams; every bad value becomes a 400 naming the field."""
    for name in _FLOAT_FIELDS:
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value}", name)
    n = 1 if req.n is None else req.n
    for name, value in (("n", n), ("best_of", best_of)):
        if value is not None and value > ctx.max_n:
            raise bad_request(f"{name} must be at most {ctx.max_n}, got {value}", name)
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise bad_request(f"temperature must be in [0, 2], got {req.temperature}", "temperature")
    if req.repetition_penalty is not None and not 0.01 <= req.repetition_penalty <= 100.0:
        raise bad_request(f"repetition_penalty must be in [0.01, 100], got {req.repetition_penalty}",
                          "repetition_penalty")
    if req.seed is not None and not _SEED_RANGE[0] <= req.seed < _SEED_RANGE[1]:
        raise bad_request("seed must fit in a signed 64-bit integer", "seed")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        # checked here: completions fold it into max(logprobs, prompt_logprobs), which would hide a -1
        raise bad_request(f"prompt_logprobs must be null or in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}",
                          "prompt_logprobs")
    logit_bias = _logit_bias(req.logit_bias, ctx.vocab_size)
    stop = _stop_strings(req.stop)
    stop_token_ids = list(req.stop_token_ids or [])
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids has {len(stop_token_ids)} entries; at most {MAX_STOP_TOKEN_IDS} are "
                          "allowed", "stop_token_ids")
    if any(not 0 <= t < ctx.vocab_size for t in stop_token_ids):
        raise bad_request(f"stop_token_ids must be in [0, {ctx.vocab_size})", "stop_token_ids")
    top_k = 0 if req.top_k is None or req.top_k >= ctx.vocab_size else req.top_k
    if max_tokens is not None and max_tokens > ctx.max_model_len:
        raise bad_request(f"max_tokens ({max_tokens}) exceeds the context length {ctx.max_model_len}", "max_tokens")
    try:
        return SamplingParams(
            n=n, best_of=best_of, max_tokens=max_tokens, logprobs=logprobs, stop=stop, stop_token_ids=stop_token_ids,
            top_k=top_k, seed=req.seed, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
            logit_bias=logit_bias, guided_decoding=guided, use_beam_search=req.use_beam_search,
            length_penalty=req.length_penalty, early_stopping=req.early_stopping,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else req.prompt_logprobs,
            final_only=not req.stream,  # a JSON body at the end: a lost worker's rerun goes unseen
            **{name: getattr(req, name) for name in _FLOAT_FIELDS if getattr(req, name) is not None},
        )
    except ValueError as exc:
        raise bad_request(str(exc), param_named_in(str(exc))) from exc


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}", "stop")
    for i, text in enumerate(stop):
        if not text:
            raise bad_request(f"stop[{i}] is empty; stop strings must be non-empty", "stop")
        if len(text) > MAX_STOP_CHARS:
            raise bad_request(f"stop[{i}] is {len(text)} characters long; at most {MAX_STOP_CHARS} are allowed",
                              "stop")
    return stop


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (as JSON object keys) -> a bias in [-100, 100]."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key) or int(key) >= vocab_size:
            shown = key if len(key) <= 20 else f"{key[:20]}..."  # a 5,000-digit key is not worth echoing
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got {shown!r}",
                              "logit_bias")
        if not math.isfinite(value) or not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        out[int(key)] = float(value)
    return out
