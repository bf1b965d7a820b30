"""Mixed traffic for benchmarks/serving.py's soak (``--mix``): each request is one of several kinds a
real deployment sees, and each kind checks its own answer.

plain       a non-streamed completion
stream      a streamed completion (the benchmark's default kind)
structured  a chat request under a JSON schema; a finished answer must parse and hold the key
tools       a chat request with a tool the model must call (tool_choice "required")
beam        a beam-search completion (use_beam_search, best_of 2)
disconnect  a streamed completion the client drops after two chunks (the server must free it)
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

KINDS = ("plain", "stream", "structured", "tools", "beam", "disconnect")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}}, "required": ["answer"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def parse_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown --mix kinds {unknown}; choose from {', '.join(KINDS)}")
    return kinds


def request(kind: str, model: str, prompt: list[int] | str, output_len: int) -> tuple[str, dict[str, Any]]:
    """(path, body) of one request of this kind."""
    text = prompt if isinstance(prompt, str) else None
    if kind in ("structured", "tools"):
        words = text or "Tell me about the weather in Paris."
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": words}], "temperature": 0,
                                "max_tokens": min(output_len, 64)}
        if kind == "structured":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
        else:
            body.update(tools=[TOOL], tool_choice="required")
        return "/v1/chat/completions", body
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    if kind == "beam":
        body.update(use_beam_search=True, best_of=2, n=1, max_tokens=min(output_len, 16), ignore_eos=False)
    if kind in ("stream", "disconnect"):
        body.update(stream=True, stream_options={"include_usage": True})
    return "/v1/completions", body


async def run_unstreamed(client: httpx.AsyncClient, kind: str, path: str, body: dict) -> tuple[int, str | None]:
    """(completion tokens, error) of a non-streamed request, its answer checked for its kind."""
    response = await client.post(path, json=body)
    if response.status_code != 200:
        return 0, f"{kind}: HTTP {response.status_code}: {response.text[:200]}"
    reply = response.json()
    choice = reply["choices"][0]
    if kind == "structured" and choice["finish_reason"] == "stop":
        try:
            if "answer" not in json.loads(choice["message"]["content"]):
                return 0, "structured: the answer lacks its key"
        except json.JSONDecodeError:
            return 0, f"structured: not JSON: {choice['message']['content'][:100]!r}"
    if kind == "tools" and choice["finish_reason"] == "tool_calls" and not choice["message"].get("tool_calls"):
        return 0, "tools: finish_reason tool_calls without calls"
    return reply["usage"]["completion_tokens"], None


async def run_disconnect(client: httpx.AsyncClient, path: str, body: dict) -> tuple[float | None, str | None]:
    """(time to the first chunk, error) of a stream dropped after two content chunks."""
    start, seen, ttft = time.perf_counter(), 0, None
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return None, f"disconnect: HTTP {response.status_code}"
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                seen += 1
                ttft = ttft if ttft is not None else time.perf_counter() - start
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
    return ttft, None if ttft is not None else "disconnect: no chunk before the drop"
