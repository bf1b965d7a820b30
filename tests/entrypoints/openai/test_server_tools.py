"""Tool calls on chat completions through the real ``openai`` client: the tools reach the prompt,
"required" and a named function are enforced by a grammar (arguments always parse and validate),
streamed calls reassemble, and the call parser and stream splitter on exact strings."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from kvmosaic.entrypoints.openai import tool_calls

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _check_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1])
def test_required_tool_choice_always_calls_with_valid_arguments(client, seed):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=1.0, seed=seed, max_tokens=120)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)


def test_named_tool_choice_calls_that_function(client):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, {"get_time"})
    assert not choice.message.content


def test_streamed_tool_calls_reassemble_into_valid_arguments(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_tool_results_go_back_into_the_conversation(client, server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    rendered = httpx.post(f"{server.url}/detokenize", json={"tokens": httpx.post(
        f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in rendered
    assert "<|im_start|>tool\n21 degrees and sunny<|im_end|>" in rendered
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                              max_tokens=30)
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_and_none_offer_the_tools_or_not(server):
    def prompt(**extra) -> str:
        body = {"messages": ASK, "max_tokens": 1, "temperature": 0, **extra}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert prompt(tools=TOOLS, tool_choice="auto") > prompt(tools=TOOLS, tool_choice="none") == prompt()


@pytest.mark.parametrize("body, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "objekt"),
])
def test_bad_tool_requests_are_400(server, body, message):
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body},
                          timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_parse_calls_keeps_text_and_unknown_blocks():
    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>\n'
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
    content, calls = tool_calls.parse_calls(text, {"get_time"})
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"timezone": "UTC"})]
    assert content == 'Let me check.\n\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    assert tool_calls.parse_calls("no calls here", {"get_time"}) == ("no calls here", [])


def test_stream_holds_back_only_what_may_be_a_call():
    stream = tool_calls.ToolCallStream({"get_time"})
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed("_call>\n{\"name\": \"get_time\", ") == ("", [])
    content, calls = stream.feed('"arguments": {"timezone": "UTC"}}\n</tool_call> bye')
    assert [c.name for c in calls] == ["get_time"] and content == " bye"
    assert stream.feed("a <b", final=False) == ("a <b", [])
    assert stream.feed(" <tool", final=True) == (" <tool", [])
