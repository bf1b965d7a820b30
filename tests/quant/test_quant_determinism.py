"""Greedy output with a KV cache of byte records (bf16, int8, int4, Oaken) is the same tokens for a prompt run alone,
in the middle of a batch of 8 with its prefill cut into chunks, and again with its prefix cached: the
decode kernel over the records and the prefill path over the dequantized blocks compute each row the
same way (tests/attention/test_quant_attention_invariance.py checks it kernel by kernel). Float weights,
so the check is on the KV cache's arithmetic."""

from __future__ import annotations

import pytest

from kvmosaic import LLM, SamplingParams

# about 240 tokens: the generated ones cross the attention's 256-token segment boundary
TARGET = "Notes from the lab: " + " ".join(
    f"sample {i} was heated to {20 + 7 * i} degrees and its mass changed by {i % 5} grams;" for i in range(12))
OTHERS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "In the beginning of the twentieth century, physics was transformed by two theories: relativity and",
    "A recipe for bread: flour, water, salt and",
    "def fibonacci(n):",
    "The three primary colours are",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4", "oaken"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_alone_batched_and_prefix_cached_agree(cached_loader, mode, dtype):
    llm = LLM(model_loader=cached_loader, dtype=dtype, kv_cache_memory="64MiB", kv_cache_dtype=mode,
              max_num_batched_tokens=96)  # prefills in chunks, split differently beside other prompts
    assert len(llm.tokenizer.encode(TARGET)) in range(233, 256)  # decode rows on both sides of the boundary
    alone = _tokens(llm, TARGET)[0]
    llm.engine.reset_prefix_cache()
    assert _tokens(llm, [*OTHERS[:3], TARGET, *OTHERS[3:]])[3] == alone
    before = llm.engine.stats()["prefix_cache_hits"]
    assert _tokens(llm, TARGET)[0] == alone  # the prompt's full blocks now come from the prefix cache
    assert llm.engine.stats()["prefix_cache_hits"] > before
