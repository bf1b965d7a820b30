"""Per-request sampling parameters, validated on creation (temperature 0 = greedy). Frozen: a
changed copy is ``dataclasses.replace(params, ...)``, validated again."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from kvmosaic.structured.params import GuidedDecoding

_GREEDY_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] = ()  # kept as a tuple
    stop_token_ids: Sequence[int] = ()  # kept as a tuple
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-N log-probabilities per generated token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # top-N log-probabilities of every prompt token (None: none)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI)
    guided_decoding: GuidedDecoding | None = None  # the grammar the output must match
    # Beam search (transformers' semantics): best_of beams, the best n returned, scored by
    # cumulative logprob / length ** length_penalty; early_stopping True, False or "never".
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # The caller reads only the finished output (no streaming), so after a lost worker the request may
    # run again from the start on another one without anyone seeing the restart.
    final_only: bool = False

    def __post_init__(self) -> None:
        normalize = partial(object.__setattr__, self)  # frozen: the normal forms are set once, here
        normalize("stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        normalize("stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.best_of is None:
            normalize("best_of", self.n)
        if self.logit_bias is not None:
            # JSON object keys arrive as strings ("1234": 5.0)
            normalize("logit_bias", {_token_key(t): b for t, b in self.logit_bias.items()})
        if self.top_k == -1:
            normalize("top_k", 0)
        if self.use_beam_search:
            normalize("temperature", 0.0)  # beams follow logprobs; nothing is drawn
        self._validate()
        if self.use_beam_search:
            _check_beam_search(self)

    def _validate(self) -> None:
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (isinstance(self.best_of, int) and self.best_of >= self.n,
             f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be -1, 0 or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            # 0: score the prompt only (prompt_logprobs), nothing generated
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 0),
             f"max_tokens must be an integer >= 0, got {self.max_tokens!r}"),
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0,
             f"min_tokens must be >= 0, got {self.min_tokens!r}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be in [0, 20], got {self.logprobs!r}"),
            (self.prompt_logprobs is None
             or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}"),
            (self.logit_bias is None or all(_bias_entry_ok(t, b) for t, b in self.logit_bias.items()),
             "logit_bias maps token ids (integers >= 0) to numbers in [-100, 100]"),
            (self.guided_decoding is None or isinstance(self.guided_decoding, GuidedDecoding),
             "guided_decoding must be a GuidedDecoding"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.max_tokens == 0 and self.best_of > 1:
            raise ValueError("max_tokens 0 scores the prompt only; n and best_of must be 1")
        if self.greedy and self.best_of > 1 and not self.use_beam_search:
            raise ValueError("best_of > 1 (or n > 1) needs temperature > 0; greedy samples would be identical")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def tracks_logprobs(self) -> bool:
        """Whether sampled tokens' logprobs are needed: asked for, or to rank best_of candidates."""
        return self.logprobs is not None or (self.best_of or 1) > self.n

    @property
    def num_top_logprobs(self) -> int:
        """Most likely tokens the sampler reports per row: what was asked, or a beam search's candidates
        (the best 4 per beam cover transformers' (1 + EOS ids) x beams for up to 3 EOS ids)."""
        return 4 * (self.best_of or 1) if self.use_beam_search else (self.logprobs or 0)

    @property
    def jump_forward(self) -> bool:
        """Whether tokens a grammar forces may be appended unsampled (they then have no logprobs)."""
        return self.logprobs is None and (self.best_of or 1) == self.n

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _bias_entry_ok(token_id: object, bias: object) -> bool:
    return (isinstance(token_id, int) and token_id >= 0 and isinstance(bias, int | float)
            and math.isfinite(bias) and -100.0 <= bias <= 100.0)


def _token_key(token_id: object) -> object:
    return int(token_id) if isinstance(token_id, str) and token_id.isdigit() else token_id


def _check_beam_search(params: SamplingParams) -> None:
    """What beam search does not combine with: the beams follow raw logprobs, and only finished
    hypotheses are returned (nothing streams), as in transformers' generate(num_beams=...)."""
    unsupported = [
        (params.guided_decoding is not None, "guided decoding"), (params.logit_bias, "logit_bias"),
        (params.logprobs is not None, "logprobs"), (bool(params.stop), "stop strings"),
        (params.min_tokens > 0, "min_tokens"), (params.prompt_logprobs is not None, "prompt_logprobs"),
        (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0,
         "penalties"),
    ]
    for used, name in unsupported:
        if used:
            raise ValueError(f"use_beam_search does not combine with {name}")
    if params.early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be true, false or 'never', got {params.early_stopping!r}")
    if not math.isfinite(params.length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {params.length_penalty}")
    if params.max_tokens == 0:
        raise ValueError("use_beam_search needs max_tokens >= 1")
