"""Fuzzing the whole OpenAPI schema with schemathesis against a live server: valid and invalid
requests for every operation get no 5xx, and the server still answers a normal request after.

The cases come from schemathesis' Hypothesis strategies, drawn inside an ordinary ``@given`` test
(its lazy pytest integration, ``from_fixture(...).parametrize()``, does not run under pytest 9).

Generated requests are kept cheap: at most 2 new tokens and 4 prompts each (large values of those
are covered by test_server_robustness); everything else goes to the server as generated. Most
generated strings hold control characters, which the server refuses at once (test_server_text), so
one run strips those to let the requests reach the engine."""

from __future__ import annotations

import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from kvmosaic import LLM
from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig

MODEL = "SmolLM2-135M-Instruct"
MAX_NEW_TOKENS = 2
MAX_PROMPTS = 4
_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


@pytest.fixture(scope="module")
def server(cached_loader):
    engine = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=256, model_loader=cached_loader).engine
    with BackgroundServer(engine, ServerConfig(port=0, max_n=4, shutdown_grace=1.0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def cases(server) -> dict[GenerationMode, st.SearchStrategy]:
    """Requests to every operation of the server's own schema: valid ones, and ones that break it."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    return {mode: schema.as_strategy(mode) for mode in GenerationMode}


def _cheap(body: object) -> None:
    """Bound the work a generated request asks for (in place)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > MAX_NEW_TOKENS):
            body[key] = MAX_NEW_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
        body["prompt"] = prompt[:MAX_PROMPTS]


def _without_controls(value: object) -> object:
    if isinstance(value, str):
        return _CONTROLS.sub("", value)
    if isinstance(value, list):
        return [_without_controls(v) for v in value]
    if isinstance(value, dict):
        return {_without_controls(k): _without_controls(v) for k, v in value.items()}
    return value


@pytest.mark.slow
@pytest.mark.parametrize("mode,strip_controls", [(GenerationMode.POSITIVE, False), (GenerationMode.NEGATIVE, False),
                                                  (GenerationMode.POSITIVE, True)],
                         ids=["valid", "invalid", "valid-no-controls"])
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_generated_request_gets_a_5xx(cases, mode, strip_controls, data):
    case = data.draw(cases[mode], label="case")
    if strip_controls and isinstance(case.body, dict):
        case.body = _without_controls(case.body)
    _cheap(case.body)
    case.call_and_validate(checks=[not_a_server_error])


def test_serves_after_the_fuzzing(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
