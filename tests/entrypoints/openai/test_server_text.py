"""Text that is valid JSON but not valid text (lone surrogates, control characters, bytes that are
not UTF-8) in any field of a request: a 400 naming the field, never a 5xx, and the server goes on
serving (issue 13: a lone surrogate in a prompt used to kill the engine loop)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmosaic import LLM
from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig

MODEL = "SmolLM2-135M-Instruct"
ERROR_KEYS = {"message", "type", "param", "code"}
HYPOTHESIS = settings(max_examples=100, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def http(cached_loader):
    engine = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, model_loader=cached_loader).engine
    with BackgroundServer(engine, ServerConfig(port=0, shutdown_grace=1.0)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict | str | bytes) -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)  # ASCII: surrogates as \ud800 escapes
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def assert_still_serves(http: httpx.Client) -> None:
    r = post(http, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def is_text(value: str) -> bool:
    """The rule the server applies, written out independently of its regular expression."""
    return all(not 0xD800 <= ord(c) <= 0xDFFF and (ord(c) >= 0x20 or c in "\t\n\r") for c in value)


def assert_names_field(r: httpx.Response, param: str | None, words: str = "is not valid text") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == "invalid_text" and words in error["message"], error
    assert error["param"] == param, error


def test_lone_surrogate_prompt_from_issue_13_gets_a_400_and_the_server_goes_on(http):
    r = post(http, "/v1/completions", '{"prompt": "\\ud800 lone surrogate", "max_tokens": 4}')
    assert_names_field(r, "prompt", "prompt is not valid text: a lone surrogate (U+D800) at character 0")
    assert_still_serves(http)
    assert http.get("/health").status_code == 200


def _completion(**fields) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0, **fields}


def _chat(message: dict | None = None, **fields) -> tuple[str, dict]:
    message = {"role": "user", "content": "Hi", **(message or {})}
    return "/v1/chat/completions", {"model": MODEL, "messages": [message], "max_tokens": 1, "temperature": 0,
                                    **fields}


# Where a string can go: (request with the text in place, the param an error must name)
TEXT_FIELDS = {
    "prompt": (lambda t: _completion(prompt=t), "prompt"),
    "prompt list": (lambda t: _completion(prompt=["Hi", t]), "prompt"),
    "completion stop": (lambda t: _completion(stop=t), "stop"),
    "completion stop list": (lambda t: _completion(stop=["x", t]), "stop"),
    "completion model": (lambda t: _completion(model=t), "model"),
    "completion user": (lambda t: _completion(user=t), "user"),
    "suffix": (lambda t: _completion(suffix=t), "suffix"),
    "logit_bias key": (lambda t: _completion(logit_bias={t: 1.0}), "logit_bias"),
    "unknown field": (lambda t: _completion(metadata={"note": [t]}), "metadata"),
    "message content": (lambda t: _chat({"content": t}), "messages"),
    "content part text": (lambda t: _chat({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": t}]}),
                          "messages"),
    "content part type": (lambda t: _chat({"content": [{"type": t, "text": "a"}]}), "messages"),
    "message role": (lambda t: _chat({"role": t}), "messages"),
    "message name": (lambda t: _chat({"name": t}), "messages"),
    "chat stop": (lambda t: _chat(stop=[t]), "stop"),
    "chat model": (lambda t: _chat(model=t), "model"),
    "chat user": (lambda t: _chat(user=t), "user"),
    "response_format": (lambda t: _chat(response_format={"type": t}), "response_format"),
    "tools": (lambda t: _chat(tools=[{"type": "function", "function": {"name": t}}]), "tools"),
}

EXAMPLES = [
    # (field, text, accepted as text)
    ("prompt", "a\x00b", False),
    ("prompt", "\x0c form feed", False),
    ("prompt", "tab\tnewline\ncr\r", True),
    ("prompt", "del \x7f and C1 \x85", True),
    ("prompt", "\udfff", False),
    ("message content", "\x1b[31m", False),
    ("content part text", "\ud83d", False),  # half of a surrogate pair
    ("content part text", "\U0001f600", True),  # the whole pair is fine
    ("chat stop", "\x00", False),
    ("logit_bias key", "\ud800", False),
    ("completion model", "\x01", False),
]


@pytest.mark.parametrize("field,text,accepted", EXAMPLES, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(EXAMPLES)])
def test_text_examples(http, field, text, accepted):
    build, param = TEXT_FIELDS[field]
    r = post(http, *build(text))
    if accepted:
        assert r.status_code == 200, r.text
    else:
        assert_names_field(r, param)


def test_error_message_gives_the_path_and_position(http):
    r = post(http, *_chat({"content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "ab\x02"}]}))
    assert_names_field(r, "messages", "messages[0].content[1].text is not valid text: the control character U+0002 "
                                      "at character 2")
    r = post(http, *_completion(logit_bias={"\udabc": 1}))
    assert_names_field(r, "logit_bias", "a key of logit_bias is not valid text: a lone surrogate (U+DABC)")
    r = post(http, "/v1/completions", '{"prompt": "hi", "\\u0000": 1}')
    assert_names_field(r, None, "a key of the request body is not valid text")


def test_bytes_that_are_not_utf8_name_the_field(http):
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "ok", "stop": ["a\xc3", "b"], "max_tokens": 1}'
    assert_names_field(post(http, "/v1/completions", body), "stop", "stop[0] is not valid text: the byte 0xC3 "
                                                                   "(not UTF-8) at character 1")
    cesu_surrogate = b'{"prompt": "\xed\xa0\x80"}'  # a surrogate encoded as if it were a character
    assert_names_field(post(http, "/v1/completions", cesu_surrogate), "prompt", "the byte 0xED (not UTF-8)")
    assert_names_field(post(http, "/v1/completions", b'{"prompt": "raw \x01 control"}'), "prompt",
                       "the control character U+0001")


def test_body_that_is_not_json_is_still_a_plain_400(http):
    for body in (b'{"prompt": \xff}', b"[" * 100_000, b'"\xff'):
        r = post(http, "/v1/completions", body)
        assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS, r.text
    assert_still_serves(http)


# ---------------------------------------------------------------- property-based
# Every code point, lone surrogates included, plus extra weight on the edges of the rule.
ANY_CHAR = st.characters(codec=None)
EDGES = st.characters(categories=["Cs"]) | st.characters(max_codepoint=0x1F) | st.just("\x7f")
TEXT = st.text(alphabet=ANY_CHAR | EDGES | st.sampled_from("ab \t\n"), max_size=12)


@pytest.mark.slow
@HYPOTHESIS
@given(field=st.sampled_from(sorted(TEXT_FIELDS)), text=TEXT)
def test_any_text_in_any_field_is_a_4xx_or_an_answer(http, field, text):
    build, param = TEXT_FIELDS[field]
    r = post(http, *build(text))
    if not is_text(text):
        assert_names_field(r, param)
        return
    assert r.status_code in (200, 400, 404, 422), r.text
    if r.status_code != 200:
        assert set(r.json()["error"]) == ERROR_KEYS and r.json()["error"]["code"] != "invalid_text", r.text


RAW = "@@raw@@"


@pytest.mark.slow
@settings(HYPOTHESIS, max_examples=50)
@given(field=st.sampled_from(["prompt", "message content", "chat stop", "completion user"]),
       raw=st.binary(max_size=8).map(lambda b: b.replace(b'"', b"").replace(b"\\", b"")))
def test_any_bytes_in_a_string_are_a_4xx_or_an_answer(http, field, raw):
    build, param = TEXT_FIELDS[field]
    path, body = build(RAW)
    r = post(http, path, json.dumps(body).encode().replace(RAW.encode(), raw))
    if not is_text(raw.decode("utf-8", "surrogateescape")):
        assert_names_field(r, param)
        return
    assert r.status_code in (200, 400), r.text


def test_serves_after_everything(http):
    assert_still_serves(http)
    assert http.get("/health").json() == {"status": "ok"}
