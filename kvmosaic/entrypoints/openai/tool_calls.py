"""Tool calls on chat completions: the tools put into the prompt, the model's calls parsed out of
its text, and ``tool_choice`` "required" / a named function enforced by a grammar.

The call format is the Hermes one most open chat models are tuned on: a JSON object with the
function's name and arguments between ``<tool_call>`` tags. A chat template that takes ``tools``
renders them itself; for one that does not (the default model's), they are described in the
system message.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvmosaic.structured import GuidedDecoding
from kvmosaic.structured.limits import check_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def check_tools(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None) -> list[dict[str, Any]]:
    """The function specs of ``tools``; ValueError for a malformed tool or a choice naming none of them."""
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function needs a name")
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        try:
            check_schema(function.get("parameters", {}))
        except ValueError as exc:
            raise ValueError(f"tools[{i}].function.parameters: {exc}") from exc
        functions.append(function)
    named = chosen_function(tool_choice)
    if named is not None and named not in {f["name"] for f in functions}:
        raise ValueError(f"tool_choice names {named!r}, which is not among the tools")
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be none, auto, required or a function, got {tool_choice!r}")
    return functions


def chosen_function(tool_choice: str | dict[str, Any] | None) -> str | None:
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ValueError("tool_choice must be {'type': 'function', 'function': {'name': ...}}")
        return name
    return None


def system_prompt(functions: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return ("You may call one or more functions to help with the user's request. The functions are "
            f"described in JSON within <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, reply with its name and arguments as a JSON object within "
            f'{OPEN}{CLOSE} tags:\n{OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CLOSE}')


def with_tool_prompt(messages: list[dict], functions: list[dict[str, Any]]) -> list[dict]:
    """The conversation with the tools described in its system message (one is added if needed)."""
    prompt = system_prompt(functions)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def render_calls(calls: list[dict[str, Any]]) -> str:
    """An assistant message's earlier tool calls as the text the model would have written."""
    blocks = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tool_calls[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                             "'arguments': ...}}")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"tool_calls[{i}].function.arguments is not JSON: {exc}") from exc
        blocks.append(f"{OPEN}\n{json.dumps({'name': function.get('name'), 'arguments': arguments})}\n{CLOSE}")
    return "\n".join(blocks)


def call_grammar(functions: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None) -> GuidedDecoding | None:
    """For "required" (one call or more, to any tool) or a named function (exactly one call to it): a
    Lark grammar whose calls' arguments follow each function's parameter schema."""
    named = chosen_function(tool_choice)
    if named is None and tool_choice != "required":
        return None
    chosen = [f for f in functions if named is None or f["name"] == named]
    rules = []
    for i, f in enumerate(chosen):
        head = json.dumps(f'{OPEN}\n{{"name": {json.dumps(f["name"])}, "arguments": ')
        tail = json.dumps(f"}}\n{CLOSE}")
        schema = f.get("parameters") or {"type": "object"}
        rules.append(f"call{i}: {head} args{i} {tail}\nargs{i}: %json {json.dumps(schema)}")
    calls = " | ".join(f"call{i}" for i in range(len(chosen)))
    start = f"start: call\ncall: {calls}" if named is not None else f'start: call ("\\n" call)*\ncall: {calls}'
    return GuidedDecoding(grammar="\n".join([start, *rules]))


def parse_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """(the text outside well-formed calls, the calls) of a finished output."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _CALL_RE.finditer(text):
        call = _parse_call(match.group(1), names)
        if call is None:
            continue  # not a call we know: left in the text
        kept.append(text[position:match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    return "".join(kept).strip() if calls else text, calls


def _parse_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], json.dumps(arguments))


class ToolCallStream:
    """Splits one choice's streamed text into content and complete calls: text that may be the start
    of a call is held back until it is one (or turns out not to be)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._pending = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed by this text)."""
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_tag_length(self._pending)
                content.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            end = self._pending.find(CLOSE, start)
            if end < 0:
                content.append(self._pending[:start])
                self._pending = self._pending[start:]
                if final:
                    content.append(self._pending)
                    self._pending = ""
                break
            call = _parse_call(self._pending[start + len(OPEN):end].strip(), self.names)
            block_end = end + len(CLOSE)
            if call is None:
                content.append(self._pending[:block_end])
            else:
                content.append(self._pending[:start])
                calls.append(call)
            self._pending = self._pending[block_end:]
        self.num_calls += len(calls)
        text_out = "".join(content)
        return (text_out.strip() if calls and not text_out.strip() else text_out), calls


def _partial_tag_length(text: str) -> int:
    """Length of the longest tail of ``text`` that begins the open tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
