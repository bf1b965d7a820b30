"""Speculative decoding on the embedded SmolLM2 model in float32: greedy output is the plain
engine's, token for token, with preemption (both modes), prefix hits, chunked prefill, quantized KV
caches and through the server's stream; logprobs are the target's."""

from __future__ import annotations

import openai
import pytest

from kvmosaic import LLM, SamplingParams
from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig

PASSAGE = ("The quick brown fox jumps over the lazy dog. The dog was not amused, and it barked at the fox "
           "until the fox ran away into the forest.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = [
    # input-grounded: the continuation copies the prompt, so n-gram lookup proposes and is accepted
    f"Repeat the following text exactly.\nText: {PASSAGE}\nRepeated text: The quick",
    f"Rename the functions to plus and minus.\n{CODE}\nRenamed:\ndef plus(a, b):\n",
    # open-ended
    "The capital of France is",
    # a shared prefix of two full blocks: the second prompt's are prefix-cache hits
    f"{PASSAGE} In short,",
    f"{PASSAGE} The moral of the story is",
]
# token_cost fixed: fitted to this host's step timings, it could turn speculation off for the batch
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
         "token_cost": 0.1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain_llm(cached_loader) -> LLM:
    return LLM(model_loader=cached_loader, dtype="float32", kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def reference(plain_llm) -> list[list[int]]:
    return _tokens(plain_llm.generate(PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def spec_llm(cached_loader) -> LLM:
    return LLM(model_loader=cached_loader, dtype="float32", kv_cache_memory="64MiB", speculative=NGRAM)


def test_greedy_with_speculation_is_plain_greedy(spec_llm, reference):
    assert _tokens(spec_llm.generate(PROMPTS, GREEDY)) == reference
    stats = spec_llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 10
    assert stats["spec_mean_accepted_length"] > 1.5
    assert stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=24, block_size=4),
    dict(num_blocks=24, block_size=4, preemption_mode="swap", num_host_blocks=64),
], ids=["recompute", "swap"])
def test_greedy_with_speculation_and_preemption(cached_loader, reference, kwargs):
    small = LLM(model_loader=cached_loader, dtype="float32", speculative=NGRAM, **kwargs)
    assert _tokens(small.generate(PROMPTS, GREEDY)) == reference
    stats = small.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["kv_blocks_used"] == 0


def test_logprobs_are_the_targets(spec_llm, plain_llm):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    expected = plain_llm.generate(PROMPTS[:1], params)[0].outputs[0]
    accepted_before = spec_llm.engine.stats()["spec_num_accepted_tokens"]
    got = spec_llm.generate(PROMPTS[:1], params)[0].outputs[0]
    assert spec_llm.engine.stats()["spec_num_accepted_tokens"] > accepted_before
    assert got.token_ids == expected.token_ids
    assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-3)
    for mine, theirs in zip(got.logprobs, expected.logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-3)


def test_seeded_sampling_reproduces_whatever_the_batch(spec_llm):
    params = SamplingParams(temperature=0.8, seed=21, max_tokens=16, ignore_eos=True)
    alone = spec_llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batched = spec_llm.generate(PROMPTS, [params if i == 0 else others for i in range(len(PROMPTS))])
    assert batched[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "oaken"])
def test_greedy_with_speculation_over_a_quantized_kv_cache(cached_loader, kv_cache_dtype):
    """Rejected guesses' K/V records are overwritten in place by the next verification: with the
    cache quantized, speculation still changes no token of the same engine's plain decoding."""
    plain = LLM(model_loader=cached_loader, dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype=kv_cache_dtype)
    expected = _tokens(plain.generate(PROMPTS, GREEDY))
    spec = LLM(model_loader=cached_loader, dtype="float32", kv_cache_memory="64MiB", kv_cache_dtype=kv_cache_dtype,
               speculative=NGRAM)
    assert _tokens(spec.generate(PROMPTS, GREEDY)) == expected
    stats = spec.engine.stats()  # guesses were both accepted and rejected (rolled back)
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert stats["kv_blocks_used"] == 0


def test_greedy_with_speculation_and_chunked_prefill(cached_loader, reference):
    """Prompts prefilled 8 tokens a step while other sequences verify their proposals."""
    chunked = LLM(model_loader=cached_loader, dtype="float32", kv_cache_memory="64MiB", speculative=NGRAM,
                  max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert _tokens(chunked.generate(PROMPTS, GREEDY)) == reference
    stats = chunked.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 10 and stats["kv_blocks_used"] == 0


def test_server_streams_accepted_tokens_as_they_come(cached_loader, reference):
    """The OpenAI server over a speculating engine: the streamed text is plain greedy decoding's, and
    a verification that accepts several tokens sends them in one chunk (fewer chunks than tokens)."""
    engine = LLM(model_loader=cached_loader, dtype="float32", kv_cache_memory="64MiB", speculative=NGRAM).engine
    tokenizer = engine.tokenizer
    with BackgroundServer(engine, ServerConfig(port=0, shutdown_grace=1.0)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=GREEDY.max_tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True})
        chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == tokenizer.decode(reference[0])
    assert chunks[-1].usage.completion_tokens == GREEDY.max_tokens
    assert 1 < len([t for t in texts if t]) < GREEDY.max_tokens
    assert engine.stats()["spec_num_accepted_tokens"] > 0
