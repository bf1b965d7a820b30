"""Bounded work per request (issue 55): every hostile input is a 4xx naming its field, never a 500,
and none of them slows other clients down.

The server runs the mock executor (next token = sum of the context % 64, word-level tokens "t0".."t63")
behind a chat template, so a step costs microseconds and any delay measured here is the server's own
work on the hostile request. ``LeakyEngine`` fails chosen requests with the kind of text a lost Ray
worker produces, to check that none of it reaches a client."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import tokenizers

from kvmosaic.engine.engine import Engine
from kvmosaic.engine.errors import EngineUnavailableError
from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig
from kvmosaic.entrypoints.openai.chat_prompt import ChatPromptEncoder
from kvmosaic.entrypoints.openai.serving_common import NO_WORKER, WORKER_FAILED
from kvmosaic.executor.mock import MockExecutor, mock_tokenizer
from kvmosaic.model.tokenizer import Tokenizer
from kvmosaic.outputs import ended_output
from kvmosaic.structured import GuidedDecoding

ERROR_KEYS = {"message", "type", "param", "code"}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RAY_DETAILS = "ActorDiedError: the actor died unexpectedly; pid=48213, ip=10.31.7.42, namespace=kvm-prod-7f3a"
LOST_SEED, NO_WORKER_SEED = 13, 14
SHORT = {"prompt": "t1 t2", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


class ChatMockExecutor(MockExecutor):
    """The mock executor with a tokenizer that has a chat template."""

    def __post_init__(self) -> None:
        super().__post_init__()
        words = tokenizers.Tokenizer.from_str(mock_tokenizer(self.vocab_size).to_json())
        self.tokenizer = Tokenizer(words, chat_template=TEMPLATE)


class LeakyEngine:
    """A mock engine, except: a request with seed LOST_SEED ends after its first output as a request whose
    worker was lost does (finish reason "abort", Ray's text as the reason), and one with NO_WORKER_SEED is
    refused as when no worker is alive, again with Ray's text."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._doomed: set[str] = set()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def add_request(self, request_id, prompt, params=None, arrival_time=None):
        if params is not None and params.seed == NO_WORKER_SEED:
            raise EngineUnavailableError(f"every decode worker is lost (the last: {RAY_DETAILS})")
        request_id = self._engine.add_request(request_id, prompt, params, arrival_time)
        if params is not None and params.seed == LOST_SEED:
            self._doomed.add(request_id)
        return request_id

    def step(self):
        outputs = self._engine.step()
        lost = {o.request_id for o in outputs if o.request_id in self._doomed}
        for request_id in lost:
            self._engine.abort(request_id, emit_output=False)
            self._doomed.discard(request_id)
        message = f"decode worker 0 was lost while running the request: {RAY_DETAILS}"
        return ([o for o in outputs if o.request_id not in lost]
                + [ended_output(rid, None, "abort", message) for rid in lost])


@pytest.fixture(scope="module")
def server():
    executor = ChatMockExecutor(num_device_blocks=1024, block_size=16, vocab_size=64, max_model_len=8192)
    with BackgroundServer(LeakyEngine(Engine(executor=executor)), ServerConfig(port=0, shutdown_grace=1.0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


ANY_PARAM = object()


def assert_error(r: httpx.Response, status: int, param: str | None | object, words: str = "") -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and words in error["message"], error
    assert param is ANY_PARAM or error["param"] == param, error
    return error


def assert_still_serves(http: httpx.Client) -> None:
    r = post(http, "/v1/completions", SHORT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text


def nested(levels: int, leaf: object) -> object:
    """A schema ``levels`` objects deep: {"type": "object", "properties": {"a": ...}}."""
    for _ in range(levels):
        leaf = {"type": "object", "properties": {"a": leaf}}
    return leaf


def chat(**fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 2, **fields}


def completion(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": "t1 t2", "max_tokens": 2, **fields}


DEEP_TEXT = "[" * 5000 + "]" * 5000
REF_LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}
BAD_INPUTS = {
    # name: ((path, body), status, param, words in the message)
    "logit_bias superscript key": (completion(logit_bias={"²": 1}), 400, "logit_bias", "token ids"),
    "logit_bias 5,000-digit key": (completion(logit_bias={"7" * 5000: 1}), 400, "logit_bias", "token ids"),
    "logit_bias of 1,025 entries": (completion(logit_bias={str(i): 1 for i in range(1025)}),
                                    400, "logit_bias", "at most 1024"),
    "tool call function not an object": (chat(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": "f"}]}]),
        400, "messages", "messages[1].tool_calls[0] must be"),
    "tool call not an object": (chat(messages=[{"role": "assistant", "tool_calls": ["f"]}]), 422, "messages", ""),
    "tool call arguments not JSON": (chat(messages=[{"role": "assistant", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": "{"}}]}]), 400, "messages", "arguments is not JSON"),
    "response_format nested 350 levels": (chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": nested(350, {"type": "string"})}}),
        400, "response_format", "deeper than 64"),
    "guided_json text nested 5,000 levels": (completion(guided_json=DEEP_TEXT), 400, "guided_json", "deeper than 64"),
    "guided_json nested 40 levels": (completion(guided_json=nested(40, {"type": "string"})), 400, "guided_json",
                                     "deeper than 64"),
    "guided_json over 64 KiB": (completion(guided_json={"enum": ["x" * 70_000]}), 400, "guided_json",
                                "at most 65536"),
    "guided_regex over 64 KiB": (completion(guided_regex="a" * 70_000), 400, "guided_regex", "at most 65536"),
    "$ref to itself": (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#"}}}), 400, "response_format", "$ref chain # -> #"),
    "$ref loop through allOf": (completion(guided_json=REF_LOOP), 400, "guided_json", "loops"),
    "tool parameters nested 40 levels": (chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": nested(40, {"type": "string"})}}]), 400, "tools", "deeper than 64"),
    "129 tools": (chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
                  400, "tools", "at most 128"),
    "prompt_logprobs -1": (completion(prompt_logprobs=-1), 400, "prompt_logprobs", "[0, 20]"),
    "prompt_logprobs -1 on chat": (chat(prompt_logprobs=-1), 400, "prompt_logprobs", "[0, 20]"),
    "prompt_logprobs 21": (completion(prompt_logprobs=21), 400, "prompt_logprobs", "[0, 20]"),
    "prompt token id 1.0": (completion(prompt=[1.0]), 422, "prompt", ""),
    "prompt token id true": (completion(prompt=[True]), 422, "prompt", ""),
    "prompt token id list with 2.0": (completion(prompt=[[1, 2.0]]), 422, "prompt", ""),
    "1,025 stop_token_ids": (completion(stop_token_ids=[1] * 1025), 400, "stop_token_ids", "at most 1024"),
    "stop_token_ids 1.0": (completion(stop_token_ids=[1.0]), 422, "stop_token_ids", ""),
    "detokenize true": (("/detokenize", {"tokens": [True]}), 422, "tokens", ""),
    "9 stop strings": (completion(stop=[f"s{i}" for i in range(9)]), 400, "stop", "at most 8"),
    "513-character stop string": (completion(stop=["x" * 513]), 400, "stop", "at most 512"),
    "empty stop string": (completion(stop=["x", ""]), 400, "stop", "stop[1] is empty"),
    "2,049 messages": (chat(messages=[{"role": "user", "content": "t1"}] * 2049), 400, "messages", "at most 2048"),
    "2,049 messages to /tokenize": (("/tokenize", {"messages": [{"role": "user", "content": "t1"}] * 2049}),
                                    400, "messages", "at most 2048"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_a_4xx_naming_the_field(http, name):
    (path, body), status, param, words = BAD_INPUTS[name]
    error = assert_error(post(http, path, body), status, param, words)
    assert len(error["message"]) < 1000  # a huge input is not echoed back whole
    assert_still_serves(http)


def test_valid_neighbours_of_the_bounds_are_accepted(http):
    for path, body in [completion(logit_bias={"63": 1}), completion(prompt=[1, 2]), completion(prompt=[[1], [2]]),
                       completion(stop=["x" * 512] * 8), ("/detokenize", {"tokens": [1, 2]}),
                       chat(messages=[{"role": "user", "content": "t1"}] * 2048, max_tokens=1),
                       chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
                           {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])]:
        r = post(http, path, body)
        assert r.status_code == 200, (body, r.text)


# ---------------------------------------------------------------- hostile requests do not slow others down
def _timed_short_requests(url: str, stop: threading.Event, times: list[float], failures: list[str]) -> None:
    """Another client: short completions, one after another, until ``stop`` is set."""
    with httpx.Client(base_url=url, timeout=60) as other:
        while not stop.is_set():
            started = time.monotonic()
            r = other.post("/v1/completions", json=SHORT)
            times.append(time.monotonic() - started)
            if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 8:
                failures.append(r.text)


def _timed_post(http: httpx.Client, path: str, body: dict | str) -> Callable[[], tuple[httpx.Response, float]]:
    """A call that posts ``body`` and returns (the response, the seconds it took)."""
    def hostile() -> tuple[httpx.Response, float]:
        started = time.monotonic()
        return post(http, path, body), time.monotonic() - started

    return hostile


def _with_other_client(server, hostile) -> tuple[object, list[float]]:
    """Run ``hostile()`` while another client sends short requests; (its result, their latencies)."""
    stop, times, failures = threading.Event(), [], []
    other = threading.Thread(target=_timed_short_requests, args=(server.url, stop, times, failures))
    other.start()
    try:
        deadline = time.monotonic() + 10
        while not times and time.monotonic() < deadline:  # the other client is served once before the hostile
            time.sleep(0.01)
        result = hostile()
        time.sleep(0.2)  # and is still served right after it
    finally:
        stop.set()
        other.join(30)
    assert not failures and len(times) >= 2, (failures, times)
    return result, times


def test_32000_one_character_messages_are_refused_fast_and_block_nobody(server, http):
    body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 32_000, "max_tokens": 8})  # ~1.1 MB

    (r, took), times = _with_other_client(server, _timed_post(http, "/v1/chat/completions", body))
    assert_error(r, 400, "messages", "at most 2048")
    assert took < 5.0, took
    assert max(times) < 1.0, times


def test_the_longest_allowed_conversation_renders_off_the_event_loop(server, http):
    # 2,048 messages of 500 words: the template and tokenizer work (~1M tokens' text) runs in a thread;
    # the engine then refuses the prompt as longer than the context.
    message = {"role": "user", "content": " ".join(["t5"] * 500)}
    body = {"messages": [message] * 2048, "max_tokens": 8}

    (r, took), times = _with_other_client(server, _timed_post(http, "/v1/chat/completions", body))
    assert_error(r, 400, ANY_PARAM, "context length")
    assert took < 30.0, took
    assert max(times) < 1.0, times


def test_large_tool_schemas_are_checked_off_the_event_loop(server, http):
    # 56 tools of ~60 KiB schemas (3.3 MB): each is walked for depth and $ref loops, then described in the
    # system prompt, which the engine refuses as longer than the context.
    fields = {f"f{i}": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#"}}}
              for i in range(600)}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": fields}}}
    body = {"messages": [{"role": "user", "content": "t1"}], "tools": [tool] * 56, "max_tokens": 8}

    (r, took), times = _with_other_client(server, _timed_post(http, "/v1/chat/completions", body))
    assert_error(r, 400, ANY_PARAM, "context length")
    assert took < 30.0, took
    assert max(times) < 1.0, times


def test_tokenizing_a_long_prompt_blocks_nobody(server, http):
    prompt = "t7 " * 1_000_000  # 3 MB, a million tokens

    (r, took), times = _with_other_client(server, _timed_post(http, "/tokenize", {"prompt": prompt}))
    assert r.status_code == 200 and r.json()["count"] == 1_000_000
    assert took < 30.0, took
    assert max(times) < 1.0, times


def test_16_stop_strings_of_40000_characters_with_n_16_are_refused(http):
    body = {"prompt": "t1 t2", "max_tokens": 8, "n": 16, "temperature": 1, "stop": ["t1 " * 13_333 + "x"] * 16}
    started = time.monotonic()
    assert_error(post(http, "/v1/completions", body), 400, "stop", "at most 8")
    assert time.monotonic() - started < 2.0


def test_the_most_stop_text_allowed_with_n_16_blocks_nobody(server, http):
    # 8 stop strings of 512 characters that keep matching the output's " tN" words partway, on 16 streams
    stops = [(f" t{i}" * 200)[:511] + "!" for i in range(8)]
    body = {"prompt": "t1 t2", "max_tokens": 300, "n": 16, "temperature": 1, "stop": stops, "ignore_eos": True,
            "stream": True}

    def hostile() -> tuple[str, float]:
        started = time.monotonic()
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = r.read().decode()
        return text, time.monotonic() - started

    (text, took), times = _with_other_client(server, hostile)
    assert text.endswith("data: [DONE]\n\n") and '"error"' not in text
    assert text.count('"finish_reason":"length"') == 16
    assert took < 30.0, took
    assert max(times) < 1.0, times


def test_linear_chat_rendering_of_32000_messages():
    """The encoder itself (the server stops at 2,048 messages): rendering and tokenizing took 11 s at
    32,000 one-character messages when each content's offset was recomputed from all earlier pieces."""
    executor = ChatMockExecutor(num_device_blocks=4, block_size=16)
    encoder = ChatPromptEncoder(executor.tokenizer)
    few = [{"role": "user", "content": "t3"}] * 2
    assert encoder.encode(few) == executor.tokenizer.encode(encoder.render(few), add_special_tokens=False)
    started = time.perf_counter()
    ids = encoder.encode([{"role": "user", "content": "t3"}] * 32_000)
    assert time.perf_counter() - started < 3.0
    assert ids == executor.tokenizer.encode(encoder.render(few * 16_000), add_special_tokens=False)


# ---------------------------------------------------------------- worker failures: no Ray details for clients
def test_a_lost_worker_is_reported_without_its_address(http, caplog):
    caplog.set_level(logging.WARNING)
    with http.stream("POST", "/v1/completions", json={**SHORT, "seed": LOST_SEED, "stream": True}) as r:
        streamed = r.read().decode()
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["message"] == WORKER_FAILED and events[-1]["error"]["code"] == "engine_error"
    whole = post(http, "/v1/completions", {**SHORT, "seed": LOST_SEED})
    assert assert_error(whole, 500, None)["message"] == WORKER_FAILED
    chat_body = {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 8, "seed": LOST_SEED}
    assert assert_error(post(http, "/v1/chat/completions", chat_body), 500, None)["message"] == WORKER_FAILED
    refused = post(http, "/v1/completions", {**SHORT, "seed": NO_WORKER_SEED})
    assert assert_error(refused, 503, None)["message"] == NO_WORKER
    for text in (streamed, whole.text, refused.text):
        assert not any(secret in text for secret in ("48213", "10.31.7.42", "kvm-prod", "ActorDied")), text
    assert "10.31.7.42" in caplog.text  # the operator still sees what happened
    assert_still_serves(http)


def test_schema_bounds_leave_ordinary_and_recursive_schemas_alone():
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    defs = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
            "$ref": "#/$defs/node"}
    for schema in (nested(20, {"type": "string"}), tree, defs, json.dumps(tree)):
        assert GuidedDecoding(json=schema).json == schema
