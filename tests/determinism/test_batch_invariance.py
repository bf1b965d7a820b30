"""A request's greedy tokens (and its logprobs, bit for bit) are the same whatever runs beside it:
alone, first or in the middle of a batch of 16 or 64, after a warm prefix (its prompt cached), with
its prompt cut into chunks, with n-gram or self-draft speculation, preempted and recomputed or swapped,
and in another engine instance; a seeded sampled request draws the same tokens alone and in a batch.
Both activation dtypes throughout; every weight format (float, Q8_0, the shipped Q4_1, Q4_K) at every
ISA level built here for the batch and prefix cases, the shipped one at the best level for the
scheduling cases (KVMOSAIC_TEST_LEVELS=best: the best level only).
Each case runs an engine instance of its own and compares against what the same prompts gave alone on
a first engine of the same level, format and dtype (so every case also compares two instances)."""

from __future__ import annotations

import functools

import pytest
import torch
from kernel_levels import levels_under_test

from kvmosaic.engine.engine import Engine
from kvmosaic.engine_args import EngineArgs
from kvmosaic.executor.local import LocalExecutor
from kvmosaic.model.loader import LoadedModel, load_model
from kvmosaic.ops import Kernels
from kvmosaic.outputs import CompletionOutput, RequestOutput
from kvmosaic.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # every case runs the full default model

FORMATS = ["none", "q8_0", "auto", "q4_k"]  # auto: the shipped file's own Q4_1 (with its Q8_0 embedding/head)
DTYPES = ["float32", "bfloat16"]
# Within the suite's time budget: every format and dtype at every level for the batch and prefix
# cases; the scheduling cases (whose kernels are those of the batch cases) with the shipped format at
# the best level.
LEVELS = levels_under_test()  # none built: every case is skipped
EVERY_CASE = [(level, f, d) for level in LEVELS for f in FORMATS for d in DTYPES]
SHIPPED = [(level, "auto", d) for level in LEVELS[:1] for d in DTYPES]
MAX_TOKENS = 24

# A: greedy with logprobs (the sampler's path, logprobs compared bit for bit); B: plain greedy (the
# kernel's greedy passes); C: seeded sampling. Each prompt fills more than one 16-token KV block, so a
# second run of it starts from a cached prefix. A repeats itself: n-gram proposals get accepted.
PROMPT_A = ("Repeat this sentence three times, exactly: the quick brown fox jumps over the lazy dog that sleeps "
            "by the old river bank.")
PROMPT_B = "Write a short story about a fish who learns to fly. Include details about the sea, the sky and the wind."
PROMPT_C = "Describe your favourite city in a few sentences, with its food, its weather and its people."
TARGETS = {
    "A": (PROMPT_A, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)),
    "B": (PROMPT_B, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)),
    "C": (PROMPT_C, SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=7, max_tokens=MAX_TOKENS,
                                   ignore_eos=True)),
}
TOPICS = ["cats", "the moon", "trains", "bread", "a lighthouse", "winter", "chess", "volcanoes", "tea", "rivers",
          "robots", "gardens", "music", "bridges", "owls", "deserts"]


def _filler(i: int) -> tuple[str, SamplingParams]:
    """Other requests of a batch: prompts of different lengths, greedy or sampled, ending at different steps."""
    prompt = f"Tell me {'one fact' if i % 3 else 'a few facts, one per line,'} about {TOPICS[i % len(TOPICS)]}" + (
        " and why people find it interesting" * (i % 4)) + "."
    params = (SamplingParams(temperature=0.0, max_tokens=6 + i % 19) if i % 2
              else SamplingParams(temperature=1.0, max_tokens=4 + i % 23))
    return prompt, params


@functools.cache
def _weights(fmt: str, dtype: str) -> LoadedModel:
    """The default model in a weight format, loaded once for every level and engine (never mutated:
    each engine packs its own copy)."""
    return load_model(None, getattr(torch, dtype), quantization=None if fmt == "none" else fmt)


def _engine(level: str, fmt: str, dtype: str, **options) -> Engine:
    options.setdefault("kv_cache_memory", "24MiB")
    config = EngineArgs(dtype=dtype, quantization=fmt, **options).create_engine_configs().engine
    return Engine(config, LocalExecutor(config, lambda path, d: _weights(fmt, dtype), Kernels.load(level)))


def _requests(engine: Engine, requests: list[tuple[str | list[int], SamplingParams]]) -> list[RequestOutput]:
    ids = [engine.add_request(None, prompt, params) for prompt, params in requests]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def _run(engine: Engine, requests: list[tuple[str, SamplingParams]]) -> list[CompletionOutput]:
    return [out.outputs[0] for out in _requests(engine, requests)]


def _result(out: CompletionOutput) -> tuple:
    return out.token_ids, out.logprobs


@functools.cache
def _alone(level: str, fmt: str, dtype: str) -> dict[str, tuple]:
    """What each target gives alone on a first engine (cold cache), run once per level, format and dtype."""
    engine = _engine(level, fmt, dtype)
    return {name: _result(_run(engine, [request])[0]) for name, request in TARGETS.items()}


def _batch(size: int, at: dict[str, int]) -> list[tuple[str, SamplingParams]]:
    """``size`` requests: each target of ``at`` at its index, fillers elsewhere."""
    where = {i: name for name, i in at.items()}
    return [TARGETS[where[i]] if i in where else _filler(i) for i in range(size)]


def _check(level: str, fmt: str, dtype: str, outs: dict[str, CompletionOutput], case: str) -> None:
    alone = _alone(level, fmt, dtype)
    for name, out in outs.items():
        assert len(out.token_ids) == MAX_TOKENS
        assert _result(out) == alone[name], f"{case}: {name} differs from its run alone ({level}, {fmt}, {dtype})"


@pytest.mark.parametrize(("level", "fmt", "dtype"), EVERY_CASE)
def test_first_and_middle_of_16_and_after_a_warm_prefix(level, fmt, dtype):
    """In a second engine instance: a batch of 16, then the three prompts again, together, their
    prompts' first blocks now cached."""
    engine = _engine(level, fmt, dtype)
    outs = _run(engine, _batch(16, {"A": 0, "B": 8, "C": 11}))
    _check(level, fmt, dtype, {"A": outs[0], "B": outs[8], "C": outs[11]}, "batch of 16")
    hits = engine.stats()["prefix_cache_hits"]
    warm = _run(engine, list(TARGETS.values()))
    assert engine.stats()["prefix_cache_hits"] >= hits + len(TARGETS)
    _check(level, fmt, dtype, dict(zip(TARGETS, warm)), "warm prefix")


@pytest.mark.parametrize(("level", "fmt", "dtype"), SHIPPED)
def test_first_and_middle_of_64(level, fmt, dtype):
    outs = _run(_engine(level, fmt, dtype, kv_cache_memory="64MiB"), _batch(64, {"A": 0, "B": 32, "C": 63}))
    _check(level, fmt, dtype, {"A": outs[0], "B": outs[32], "C": outs[63]}, "batch of 64")


@pytest.mark.parametrize(("level", "fmt", "dtype"), SHIPPED)
def test_chunked_prefill(level, fmt, dtype):
    """A token budget of 20 a step: a prompt is cut into a prefill span and a tail of decode rows, which
    share steps with the other sequences' decode rows."""
    outs = _run(_engine(level, fmt, dtype, max_num_batched_tokens=20), _batch(5, {"A": 1, "B": 3, "C": 4}))
    _check(level, fmt, dtype, {"A": outs[1], "B": outs[3], "C": outs[4]}, "chunked prefill")


@pytest.mark.parametrize(("level", "fmt", "dtype"), SHIPPED)
@pytest.mark.parametrize("method", ["ngram", "self"])
def test_speculative_decoding(level, fmt, dtype, method):
    """Greedy verification keeps the target's own tokens: the same with proposals as without (a
    sequence's proposals are decode rows over contexts that grow row by row)."""
    engine = _engine(level, fmt, dtype, speculative={"method": method, "num_speculative_tokens": 4,
                                                     "adaptive": False})
    alone = {name: _run(engine, [TARGETS[name]])[0] for name in ("A", "B")}
    assert engine.stats()["spec_num_draft_tokens"] > 0  # verified: accepted or not, the rows ran
    outs = _run(engine, [TARGETS["B"], _filler(1), TARGETS["A"]])
    _check(level, fmt, dtype, alone, f"{method} speculation, alone")
    _check(level, fmt, dtype, {"A": outs[2], "B": outs[0]}, f"{method} speculation, batch")


@pytest.mark.parametrize(("level", "fmt", "dtype"), SHIPPED)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_and_resumed(level, fmt, dtype, mode):
    """Six KV blocks for three sequences that grow to three or four each: the newest ones are
    preempted, then recomputed from their tokens (prompt and output so far, as one prefill) or swapped
    back in."""
    engine = _engine(level, fmt, dtype, num_blocks=6, preemption_mode=mode, num_host_blocks=32,
                     enable_prefix_caching=False)
    outs = _run(engine, list(TARGETS.values()))
    assert engine.stats()["num_preemptions"] > 0
    _check(level, fmt, dtype, dict(zip(TARGETS, outs)), f"preemption ({mode})")


@pytest.mark.parametrize(("level", "fmt", "dtype"), SHIPPED)
def test_decode_logprobs_equal_the_prefill_of_the_same_tokens(level, fmt, dtype):
    """A's tokens decoded one step at a time score, bit for bit, what the prefill of its prompt and
    those tokens scores them (prompt logprobs): the 1-row decode path and the prefill path agree."""
    engine = _engine(level, fmt, dtype)
    decoded = _requests(engine, [TARGETS["A"]])[0]
    tokens, logprobs = decoded.outputs[0].token_ids, decoded.outputs[0].logprobs
    prompt = list(decoded.prompt_token_ids)
    scored = _requests(engine, [(prompt + tokens, SamplingParams(max_tokens=1, prompt_logprobs=0))])[0]
    prefill = [entry[t] for entry, t in zip(scored.prompt_logprobs[len(prompt):], tokens, strict=True)]
    assert prefill == [lp[t] for lp, t in zip(logprobs, tokens, strict=True)]
