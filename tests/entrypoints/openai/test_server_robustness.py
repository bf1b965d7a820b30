"""The server under bad input, disconnects and overload: documented 4xx/503 answers with
OpenAI-style bodies, aborted requests that free their KV blocks, and no 5xx for any request body.

The server here runs one sequence at a time (max_num_seqs=1) with a waiting queue of 2, so
queueing (and disconnecting while queued) can be produced on demand."""

from __future__ import annotations

import json
import time
from contextlib import closing

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmosaic import LLM
from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig

MODEL = "SmolLM2-135M-Instruct"
LONG_RUN = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
            "temperature": 0, "stream": True}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(cached_loader):
    engine = LLM(dtype="float32", kv_cache_memory="128MiB", max_num_seqs=1, model_loader=cached_loader).engine
    with BackgroundServer(engine, ServerConfig(port=0, max_waiting=2, max_n=16, shutdown_grace=1.0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"{name} ") or line.startswith(f"{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(http: httpx.Client, timeout: float = 5.0) -> None:
    """Running requests and used KV blocks drop to 0 (cached free blocks are not 'used')."""
    deadline = time.monotonic() + timeout
    while True:
        values = [metric(http, f"kvmosaic_{n}") for n in ("num_requests_running", "num_requests_waiting",
                                                           "num_requests_queued", "kv_blocks_used")]
        if values == [0, 0, 0, 0]:
            return
        assert time.monotonic() < deadline, f"not idle: running, waiting, queued, blocks = {values}"
        time.sleep(0.02)


def assert_still_serves(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


class Stream:
    """A streaming completion read event by event (abandoning an httpx line iterator closes the connection)."""

    def __init__(self, http: httpx.Client, body: dict) -> None:
        self.response = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
        assert self.response.status_code == 200, self.response.read()
        self._lines = self.response.iter_lines()

    def next_event(self) -> dict:
        for line in self._lines:
            if line.startswith("data: {"):
                return json.loads(line[6:])
        raise AssertionError("stream ended without an event")

    def close(self) -> None:  # the client disconnects
        self.response.close()


LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 150
BAD_INPUTS = [
    # (path, body (dict, or raw str), status, words in the message, param)
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 7000}, 400, "context length", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 9000}, 400, "context length", "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT * 6}]}, 400, "context length",
     None),
    ("/v1/chat/completions", {"messages": []}, 400, "non-empty", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "no content", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "text content", "messages"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "n": 2, "temperature": 1}, 400, "max_tokens 0",
     "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed", "seed"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', 400, "finite", "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n must be", "n"),
    ("/v1/completions", {"prompt": "hi", "n": 64, "temperature": 1}, 400, "at most 16", "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0}, 400, "temperature > 0", "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "logprobs", "top_logprobs"),
    ("/v1/completions", {"prompt": ""}, 400, "empty", "prompt"),
    ("/v1/completions", {"prompt": [49152]}, 400, "token ids", "prompt"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 3', 400, "not valid JSON", None),
    ("/v1/completions", "", 400, "empty", None),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "does not exist", "model"),
    ("/v1/nothing", {}, 404, "Not Found", None),
    ("/v1/completions", {"max_tokens": 3}, 422, "Field required", "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 422, "valid number", "temperature"),
    ("/v1/chat/completions", {"messages": "hello"}, 422, "valid list", "messages"),
]


@pytest.mark.parametrize("path,body,status,words,param", BAD_INPUTS, ids=[f"{i}" for i in range(len(BAD_INPUTS))])
def test_bad_input_gets_documented_error(http, path, body, status, words, param):
    if isinstance(body, str):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and words in error["message"], error
    if param is not None:
        assert error["param"] == param
    assert_still_serves(http)


def test_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def test_disconnect_mid_stream_aborts_and_frees_blocks(http):
    aborted = metric(http, "kvmosaic_request_aborted_total")
    with closing(Stream(http, LONG_RUN)) as stream:
        stream.next_event()
        assert metric(http, "kvmosaic_kv_blocks_used") > 0
        assert metric(http, "kvmosaic_num_requests_running") == 1
    wait_idle(http, timeout=2.0)
    assert metric(http, "kvmosaic_request_aborted_total") == aborted + 1
    assert_still_serves(http)


def test_disconnect_before_first_token_aborts_the_waiting_request(http):
    aborted = metric(http, "kvmosaic_request_aborted_total")
    with closing(Stream(http, LONG_RUN)) as running:
        running.next_event()  # holds the only sequence slot
        with closing(Stream(http, LONG_RUN)):
            assert metric(http, "kvmosaic_num_requests_queued") == 1  # accepted, no token yet
        deadline = time.monotonic() + 2.0
        while metric(http, "kvmosaic_num_requests_queued") or metric(http, "kvmosaic_num_requests_waiting"):
            assert time.monotonic() < deadline, "the waiting request was not aborted"
            time.sleep(0.02)
        assert metric(http, "kvmosaic_num_requests_running") == 1  # the other request goes on
    wait_idle(http, timeout=2.0)
    assert metric(http, "kvmosaic_request_aborted_total") == aborted + 2
    assert_still_serves(http)


def test_disconnect_while_waiting_for_a_whole_answer_aborts_it(http, server):
    aborted = metric(http, "kvmosaic_request_aborted_total")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=dict(LONG_RUN, stream=False), timeout=0.5)
    wait_idle(http, timeout=2.0)
    assert metric(http, "kvmosaic_request_aborted_total") == aborted + 1


def test_full_waiting_queue_answers_503_then_recovers(http):
    running = Stream(http, LONG_RUN)
    running.next_event()  # holds the only sequence slot
    waiting = [Stream(http, LONG_RUN) for _ in range(2)]  # accepted, waiting for a first token
    assert metric(http, "kvmosaic_num_requests_queued") == 2
    refused = http.post("/v1/completions", json=dict(LONG_RUN, stream=False))
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "queue_full" and "overloaded" in refused.json()["error"]["message"]
    assert metric(http, "kvmosaic_num_requests_running") == 1
    for stream in [running, *waiting]:
        stream.close()
    wait_idle(http)
    assert_still_serves(http)


def test_batch_larger_than_the_waiting_queue_is_refused_whole(http):
    aborted = metric(http, "kvmosaic_request_aborted_total")
    # long enough that neither admitted prompt can finish before it is withdrawn
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 1000, "ignore_eos": True}
    refused = http.post("/v1/completions", json=body)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full", refused.text
    wait_idle(http)  # the two prompts admitted before the refusal were withdrawn, the queue count is back to 0
    assert metric(http, "kvmosaic_request_aborted_total") == aborted + 2
    accepted = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
    assert accepted.status_code == 200 and len(accepted.json()["choices"]) == 2
    wait_idle(http)


# ---------------------------------------------------------------- property-based: no 5xx, ever
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """valid values 5 times in 6, so that a fair share of generated requests is accepted."""
    return st.integers(0, 5).flatmap(lambda i: invalid if i == 0 else valid)


# max_tokens is never null or large, so every accepted request stays a few tokens long
TOKEN_COUNT = _mostly(st.integers(1, 3), st.integers(-2, 0) | st.sampled_from(["x", [], {}, True, 2.5]))
SAMPLING = {
    "model": _mostly(st.just(MODEL), st.sampled_from(["other-model", None])),
    "temperature": _mostly(st.floats(0.1, 2), st.floats(-1, 3) | JUNK),
    "top_p": _mostly(st.floats(0.01, 1), st.floats(-0.5, 1.5) | JUNK),
    "top_k": _mostly(st.integers(-1, 60_000), st.integers(-(2**64), -2) | JUNK),
    "min_p": _mostly(st.floats(0, 1), st.floats(-0.5, 1.5) | JUNK),
    "presence_penalty": _mostly(st.floats(-2, 2), st.floats(-3, 3)),
    "frequency_penalty": _mostly(st.floats(-2, 2), st.floats(-3, 3)),
    "repetition_penalty": _mostly(st.floats(0.5, 2), st.floats(-1, 200) | JUNK),
    "seed": _mostly(st.integers(0, 2**32), st.integers(-(2**65), 2**65)),
    "stop": _mostly(st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3),
                    st.lists(st.text(max_size=4), max_size=20) | JUNK),
    "stop_token_ids": _mostly(st.lists(st.integers(0, 49_151), max_size=3), st.lists(st.integers(-5, 60_000))),
    "ignore_eos": _mostly(st.booleans(), JUNK),
    "min_tokens": _mostly(st.integers(0, 2), st.integers(-1, 4) | st.sampled_from(["x", None])),
    "n": _mostly(st.integers(1, 3), st.integers(-1, 20) | JUNK),
    "stream": _mostly(st.booleans(), JUNK),
    "stream_options": _mostly(st.fixed_dictionaries({"include_usage": st.booleans()}), JUNK),
    "logit_bias": _mostly(st.dictionaries(st.integers(0, 49_151).map(str), st.floats(-100, 100), max_size=2),
                          st.dictionaries(st.text(max_size=3), st.floats(-200, 200), max_size=2)),
    "guided_regex": _mostly(st.sampled_from(["[a-z]{1,3}", "yes|no", r"\d+"]), st.text(max_size=5) | JUNK),
    "guided_choice": _mostly(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3),
                             st.lists(st.text(max_size=3), max_size=2) | JUNK),
    "guided_json": _mostly(st.just({"type": "object", "properties": {"a": {"type": "integer"}}}),
                           st.dictionaries(st.sampled_from(["type", "properties", "enum"]), JUNK, max_size=2)),
    "prompt_logprobs": _mostly(st.integers(0, 3), st.integers(-1, 30) | JUNK),
}
MESSAGE = st.fixed_dictionaries({
    "role": _mostly(st.sampled_from(["system", "user", "assistant", "developer"]), st.just("robot") | JUNK),
    "content": _mostly(st.text(max_size=30), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2) | JUNK),
})
PROMPT = _mostly(st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 49_151), min_size=1, max_size=6),
                 st.lists(st.integers(-2, 50_000), max_size=6) | st.lists(st.text(max_size=10), max_size=3) | JUNK)
COMPLETION_BODY = st.fixed_dictionaries(
    {"prompt": PROMPT, "max_tokens": TOKEN_COUNT},
    optional={**SAMPLING, "logprobs": _mostly(st.integers(0, 5), st.integers(-1, 25) | JUNK),
              "best_of": _mostly(st.integers(1, 3), st.integers(-1, 20) | JUNK), "echo": st.booleans()},
)
CHAT_BODY = st.fixed_dictionaries(
    {"messages": _mostly(st.lists(MESSAGE, min_size=1, max_size=3), st.lists(MESSAGE, max_size=0) | JUNK),
     "max_tokens": TOKEN_COUNT},
    optional={**SAMPLING, "max_completion_tokens": TOKEN_COUNT, "logprobs": st.booleans(),
              "top_logprobs": _mostly(st.integers(0, 5), st.integers(-1, 25) | JUNK),
              "tools": _mostly(st.just([]), st.lists(JUNK, max_size=1)),
              "tool_choice": _mostly(st.sampled_from(["auto", "none", "required"]), JUNK),
              "response_format": _mostly(st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                                         st.fixed_dictionaries({"type": st.text(max_size=12)}) | JUNK)},
)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(request=st.one_of(st.tuples(st.just("/v1/completions"), COMPLETION_BODY),
                         st.tuples(st.just("/v1/chat/completions"), CHAT_BODY),
                         st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), JUNK)))
def test_no_request_body_gets_a_5xx(http, request):
    path, body = request
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    if r.status_code == 503:  # a batch of more prompts than the waiting queue holds (2) is refused whole
        prompt = body.get("prompt") if isinstance(body, dict) else None
        assert isinstance(prompt, list) and len(prompt) > 2, r.text
        assert all(isinstance(p, str | list) for p in prompt), r.text
        assert r.json()["error"]["code"] == "queue_full", r.text
        return
    assert r.status_code in (200, 400, 404, 422), r.text
    if r.status_code != 200:
        assert set(r.json()["error"]) == ERROR_KEYS
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
    else:
        assert r.json()["choices"] is not None


def test_idle_after_everything(http):
    wait_idle(http)
