"""The speculative-decoding configuration (``LLM(speculative=...)``, ``--speculative``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from kvmosaic.config_values import WEIGHT_QUANTIZATIONS, is_fraction, is_int

SPECULATIVE_METHODS = ("ngram", "draft", "self")
DRAFT_MODEL_METHODS = ("draft", "self")  # proposals come from a model the worker runs


class SpeculativeConfigError(ValueError):
    """A speculative-decoding configuration that cannot be used (unknown key, method or bad value)."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: proposals of ``method`` verified by the target, lossless.

    ``ngram``: prompt lookup, the longest suffix of ``prompt_lookup_min`` .. ``prompt_lookup_max``
    tokens found earlier in the sequence proposes what followed it. ``draft``: a small model with
    the target's tokenizer (``model``: any path kvmosaic loads) proposes autoregressively; ``self``:
    the target's own weights in ``quantization`` (default q8_0) do, over the target's own K/V
    (no second pool, nothing mirrored). ``quantization`` is the draft's
    weight format (WEIGHT_QUANTIZATIONS; default "auto" for ``draft``: the file's own). ``adaptive``: each sequence's k
    follows its measured acceptance (down to 0) and shrinks as the batch grows; ``token_cost`` is
    what one more verified token costs relative to one sequence's decode step (weights read once):
    None fits it to the engine's timed steps (kvmosaic/core/speculation/step_cost.py; 0.1 until they determine
    it), a number fixes it (reproducible choices of k, whatever the host's speed),
    ``step_overhead`` what a step with proposals costs on top (it leaves the one-token decode path);
    ``draft_cost`` what one pass of a draft model costs relative to the target's decode step: None
    times it (0.25 until timed), a number fixes it; ``lookup_first`` (draft methods): a sequence whose
    last tokens occurred earlier takes the prompt lookup's proposal (as ``ngram``, no draft passes)
    and is drafted by the model only when the lookup finds nothing.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    adaptive: bool = True
    token_cost: float | None = None
    step_overhead: float = 0.15
    draft_cost: float | None = None
    lookup_first: bool = True
    model: str | None = None  # the draft model's path (method "draft")
    quantization: str | None = None  # the draft's weight format; None: q8_0 for "self", auto for "draft"

    def __post_init__(self) -> None:
        checks = [
            (self.method in SPECULATIVE_METHODS, f"speculative method must be one of {SPECULATIVE_METHODS}, "
                                                 f"got {self.method!r}"),
            (is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 32,
             f"num_speculative_tokens must be an integer in [1, 32], got {self.num_speculative_tokens!r}"),
            (is_int(self.prompt_lookup_min) and is_int(self.prompt_lookup_max)
             and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             "prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, got "
             f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}"),
            (isinstance(self.adaptive, bool), f"adaptive must be true or false, got {self.adaptive!r}"),
            (isinstance(self.lookup_first, bool), f"lookup_first must be true or false, got {self.lookup_first!r}"),
            (self.token_cost is None or is_fraction(self.token_cost),
             f"token_cost must be None or in [0, 1], got {self.token_cost!r}"),
            (is_fraction(self.step_overhead), f"step_overhead must be in [0, 1], got {self.step_overhead!r}"),
            (self.draft_cost is None or is_fraction(self.draft_cost),
             f"draft_cost must be None or in [0, 1], got {self.draft_cost!r}"),
            ((self.method == "draft") == (self.model is not None),
             f"method 'draft' takes the draft's path as 'model' (other methods none), got method={self.method!r}, "
             f"model={self.model!r}"),
            (self.model is None or isinstance(self.model, str), f"model must be a path, got {self.model!r}"),
            (self.quantization is None or (self.method in DRAFT_MODEL_METHODS
                                           and str(self.quantization).lower() in WEIGHT_QUANTIZATIONS),
             f"quantization is the draft's weight format (methods draft/self), one of {WEIGHT_QUANTIZATIONS}; "
             f"got {self.quantization!r} for method {self.method!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise SpeculativeConfigError(message)

    @property
    def uses_draft_model(self) -> bool:
        return self.method in DRAFT_MODEL_METHODS

    @property
    def draft_shares_cache(self) -> bool:
        """The draft has the target's shape and attends over the target's K/V (``self``)."""
        return self.method == "self"

    @property
    def draft_quantization(self) -> str:
        """The draft's weight format, defaults resolved."""
        if self.quantization is not None:
            return str(self.quantization).lower()
        return "q8_0" if self.method == "self" else "auto"

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping | str | None) -> SpeculativeConfig | None:
        """From a config, a dict or a JSON object string (the CLI's); None or {} means off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError(f"speculative config is not valid JSON: {exc}") from exc
        if not isinstance(value, Mapping):
            raise SpeculativeConfigError(f"speculative config must be an object, got {type(value).__name__}")
        if not value:
            return None
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise SpeculativeConfigError(f"unknown speculative config keys: {sorted(unknown)}")
        return cls(**value)
