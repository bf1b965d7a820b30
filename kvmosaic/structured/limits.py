"""Bounds on what a request may ask the grammar compiler to build, checked before it runs.

A schema nested a few hundred levels deep exhausts Python's stack in the passes over it (the
closing of objects, json.dumps for the cache key) on the engine thread, and a ``$ref`` that leads
back to itself compiles to a grammar nothing matches (an empty answer instead of an error). Both
are refused here, as ValueErrors, together with inputs too large to be an output format.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # JSON nesting levels; real schemas use under 20, llguidance itself gives up near 350
MAX_CHARS = 64 * 1024  # a schema, regex, grammar or choice list this large is a payload, not a format
_PASS_THROUGH = ("$ref", "allOf", "anyOf", "oneOf")  # keywords that produce no output of their own


def check_size(text: str, what: str) -> None:
    if len(text) > MAX_CHARS:
        raise ValueError(f"{what} is {len(text)} characters long; at most {MAX_CHARS} are allowed")


def parse_schema_text(text: str) -> Any:
    """A schema given as JSON text, parsed once its size is known to be bounded."""
    check_size(text, "the JSON schema")
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError(f"the JSON schema nests deeper than {MAX_DEPTH} levels") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"guided_json is not valid JSON: {exc}") from exc


def check_schema(schema: Any) -> None:
    """ValueError for a schema too deep, too large, or whose ``$ref`` chain loops."""
    try:  # the size first, at C speed, so that the walks below cover at most MAX_CHARS of schema
        text = json.dumps(schema)
    except RecursionError as exc:
        raise ValueError(f"the JSON schema nests deeper than {MAX_DEPTH} levels") from exc
    check_size(text, "the JSON schema")
    check_depth(schema, "the JSON schema")
    loop = _ref_loop(schema)
    if loop is not None:
        raise ValueError(f"the JSON schema's $ref chain {' -> '.join(loop)} loops without describing any value")


def check_depth(value: Any, what: str) -> None:
    """ValueError if ``value`` nests lists and objects deeper than MAX_DEPTH (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > MAX_DEPTH:
            raise ValueError(f"{what} nests deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)


def _ref_loop(schema: Any) -> list[str] | None:
    """A cycle of local ``$ref`` / allOf / anyOf / oneOf links (as JSON pointers), if the schema has one.

    Going round such a cycle emits nothing, so the compiled grammar recurses forever without output.
    A ref that passes through ``properties`` or ``items`` (a tree of nodes) is a real recursive type."""
    state: dict[str, int] = {}  # pointer -> 1 on the current path, 2 done
    for start in _pointers_with_links(schema):
        if state.get(start):
            continue
        path = [start]
        pending = [iter(_links(schema, start))]
        state[start] = 1
        while pending:
            target = next(pending[-1], None)
            if target is None:
                state[path.pop()] = 2
                pending.pop()
            elif state.get(target) == 1:
                return path[path.index(target):] + [target]
            elif not state.get(target):
                state[target] = 1
                path.append(target)
                pending.append(iter(_links(schema, target)))
    return None


def _pointers_with_links(schema: Any) -> list[str]:
    """JSON pointers of every object in the schema that has a pass-through keyword."""
    found = []
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, pointer = stack.pop()
        if isinstance(node, dict):
            if any(key in node for key in _PASS_THROUGH):
                found.append(pointer)
            stack.extend((child, f"{pointer}/{_escape(key)}") for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((child, f"{pointer}/{i}") for i, child in enumerate(node))
    return found


def _links(schema: Any, pointer: str) -> list[str]:
    """Where the object at ``pointer`` passes on to without emitting anything itself."""
    node = _resolve(schema, pointer)
    if not isinstance(node, dict):
        return []
    links = []
    ref = node.get("$ref")
    is_pointer = isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))  # not "#anchor" or another file
    if is_pointer and _resolve(schema, ref) is not None:
        links.append(ref.rstrip("/") or "#")
    for key in _PASS_THROUGH[1:]:
        members = node.get(key)
        if isinstance(members, list):
            links.extend(f"{pointer}/{key}/{i}" for i in range(len(members)))
    return links


def _resolve(schema: Any, pointer: str) -> Any:
    """The value a local JSON pointer ("#", "#/$defs/a") names, or None."""
    node = schema
    for part in pointer.removeprefix("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
