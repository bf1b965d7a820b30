"""Structured output, prompt logprobs / echo, logit_bias, suffix and /tokenize through the server,
driven by the real ``openai`` client; prompt logprobs against transformers' log-softmax."""

from __future__ import annotations

import json
from typing import Annotated

import httpx
import jsonschema
import pydantic
import pytest
import torch

from kvmosaic import LLM, SamplingParams
from kvmosaic.structured import GuidedDecoding

MODEL = "SmolLM2-135M-Instruct"
PERSON_PROMPT = [{"role": "user", "content": "Describe a person named Bob who is 42 years old, as JSON."}]


class Person(pydantic.BaseModel):
    # bounded, since a 135M model's greedy output can repeat a list item until max_tokens
    name: str = pydantic.Field(max_length=30)
    age: int
    hobbies: list[Annotated[str, pydantic.Field(max_length=20)]] = pydantic.Field(max_length=3)


def test_parse_returns_a_pydantic_object(client):
    completion = client.beta.chat.completions.parse(model=MODEL, messages=PERSON_PROMPT, response_format=Person,
                                                    temperature=0, max_tokens=100)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed.name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_json_always_validates(client, seed):
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0},
        "rivers": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3},
        "capital": {"type": "boolean"}}, "required": ["city", "population", "rivers", "capital"]}
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}], temperature=1.0, seed=seed,
        max_tokens=150, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_guided_extensions(client):
    ask = [{"role": "user", "content": "Give a JSON object with one key 'x' set to 1."}]
    response = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=80,
                                              response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    choice = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0.7,
                                       seed=3, extra_body={"guided_choice": ["yes", "no", "maybe"]}).choices[0]
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    text = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=30, temperature=0.9, seed=4,
                                     extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"}).choices[0].text
    assert len(text) == 14 and text[0] == "(" and text[4:6] == ") " and text[9] == "-"
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'  # GBNF, as llama.cpp users write it
    text = client.completions.create(model=MODEL, prompt="Q: Is 2 even?", max_tokens=10, temperature=0,
                                     extra_body={"guided_grammar": grammar}).choices[0].text
    assert text in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "objekt"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
])
def test_bad_constraints_are_400(server, body, message):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"messages": PERSON_PROMPT, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_server_keeps_serving_after_bad_constraints(client):
    test_bad_constraints_are_400  # noqa: B018  (the requests above ran on the same server)
    response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert response.choices[0].finish_reason == "length"


def test_echo_with_max_tokens_0_returns_prompt_logprobs_equal_to_hf(client, hf_gguf_model, server):
    prompt = "The quick brown fox jumps over the lazy dog."
    choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0).choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    with torch.no_grad():
        reference = torch.log_softmax(hf_gguf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None]).flatten()
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and logprobs.token_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:]), expected, atol=1e-4, rtol=0)
    assert all(len(top) in (1, 2) for top in logprobs.top_logprobs[1:])  # the top one, plus the actual one
    assert "".join(logprobs.tokens) == prompt


def test_echo_with_generated_tokens_and_logit_bias(client):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0).choices[0]
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                       logprobs=0).choices[0]
    assert echoed.text == prompt + plain.text
    assert len(echoed.logprobs.token_logprobs) == len(echoed.logprobs.tokens)
    # a +100 bias makes a token certain; -100 bans the greedy choice
    base = f"{client.base_url}".removesuffix("/v1/")
    token_text = httpx.post(f"{base}/detokenize", json={"tokens": [28]}).json()["prompt"]
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                       logit_bias={"28": 100}).choices[0].text
    assert forced == token_text * 3
    first = httpx.post(f"{base}/tokenize", json={"prompt": plain.text}).json()["tokens"][0]
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100}).choices[0].text
    assert banned and not plain.text.startswith(banned)


def test_suffix_needs_fill_in_the_middle_tokens(server):
    response = httpx.post(f"{server.url}/v1/completions",
                          json={"prompt": "def f(", "suffix": "return x", "max_tokens": 4})
    assert response.status_code == 400
    assert "fill-in-the-middle" in response.json()["error"]["message"]


def test_tokenize_and_detokenize(server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] > 0
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    rendered = httpx.post(f"{server.url}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert rendered.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in rendered
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [-1]}).status_code == 400
    assert httpx.post(f"{server.url}/tokenize", json={}).status_code == 400


def test_constrained_greedy_equals_unconstrained_when_it_already_matches(cached_loader):
    """The mask must not change which allowed token wins: with a constraint the free output satisfies,
    the constrained greedy tokens are the same (jump-forward on, and off through logprobs)."""
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", model_loader=cached_loader)
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with only a JSON object with keys a and b, both numbers."}])
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert "{" in free.text
    # only the characters the free output uses (most of the vocabulary is masked), and its own opening
    chars = "".join(sorted(set(free.text)))
    char_class = "".join("\\n" if c == "\n" else c if c.isalnum() else "\\" + c for c in chars)
    opening = json.dumps(free.text[: free.text.index("{")])
    constraints = [GuidedDecoding(regex=f"[{char_class}]*"), GuidedDecoding(grammar=f"start: {opening} /(.|\\n)*/")]
    for guided in constraints:
        for logprobs in (None, 0):
            params = SamplingParams(temperature=0, max_tokens=40, logprobs=logprobs, guided_decoding=guided)
            out = llm.generate([prompt], params)[0].outputs[0]
            assert out.token_ids[: len(free.token_ids)] == free.token_ids, guided


def test_use_beam_search_extension_equals_offline_beam_search(client, cached_loader):
    prompt = "The capital of France is"
    offline = LLM(dtype="float32", kv_cache_memory="64MiB", model_loader=cached_loader)
    expected = offline.beam_search([prompt], beam_width=3, max_tokens=8, num_return=2)[0].outputs
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=2, best_of=3,
                                         extra_body={"use_beam_search": True})
    assert [c.text for c in response.choices] == [c.text for c in expected]
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=2, best_of=3, stream=True,
                                         extra_body={"use_beam_search": True})
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in expected]
