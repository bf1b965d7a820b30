"""API fields that constrain the output -> GuidedDecoding: OpenAI's ``response_format`` and vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` extensions."""

from __future__ import annotations

from typing import Any

from kvmosaic.entrypoints.openai.errors import bad_request
from kvmosaic.entrypoints.openai.protocol import SamplingRequest
from kvmosaic.structured import GuidedDecoding

_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided_decoding(req: SamplingRequest, response_format: dict[str, Any] | None = None) -> GuidedDecoding | None:
    """The request's output constraint, or None; a 400 for a malformed or ambiguous one (a schema
    that does not compile is refused by the engine, also as a 400)."""
    given = {name: getattr(req, name) for name in _FIELDS if getattr(req, name) is not None}
    from_format = _from_response_format(response_format)
    if from_format is not None:
        given["response_format"] = from_format
    if len(given) > 1:
        raise bad_request(f"at most one output constraint per request; got {', '.join(given)}", next(iter(given)))
    if not given:
        return None
    name, value = given.popitem()
    if name == "response_format":
        return value
    try:
        return GuidedDecoding(**{name.removeprefix("guided_"): value})
    except ValueError as exc:
        raise bad_request(str(exc), name) from exc


def _from_response_format(response_format: dict[str, Any] | None) -> GuidedDecoding | None:
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                              "response_format")
        try:
            return GuidedDecoding(json=schema)
        except ValueError as exc:
            raise bad_request(str(exc), "response_format") from exc
    raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                      "response_format")
