"""What a request asks its output to match: exactly one of a JSON schema, any JSON object, a regex,
a list of choices or a grammar (Lark, or llama.cpp's GBNF)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvmosaic.structured.limits import check_schema, check_size, parse_schema_text

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    json: dict[str, Any] | str | None = None  # a JSON schema (an object, or its text)
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect), or GBNF when it defines `root ::=`

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"guided decoding takes exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if self.choice is not None:
            choices_ok = not isinstance(self.choice, str) and all(isinstance(c, str) and c for c in self.choice)
            if not self.choice or not choices_ok:
                raise ValueError("guided_choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"guided_{kind} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("guided_json must be a JSON schema object or its text")
        self._check_bounds()

    def _check_bounds(self) -> None:
        """Refuse, before the engine compiles anything, inputs too deep or too large to compile safely."""
        if self.json is not None:
            check_schema(parse_schema_text(self.json) if isinstance(self.json, str) else self.json)
        for kind in ("regex", "grammar"):
            if getattr(self, kind) is not None:
                check_size(getattr(self, kind), f"guided_{kind}")
        if self.choice is not None:
            check_size("".join(self.choice), "guided_choice")

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> str:
        """The same text for the same constraint: compiled grammars are cached by it."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"guided_json is not valid JSON: {exc}") from exc
        return f"{self.kind}:{json.dumps(value, sort_keys=True)}"
