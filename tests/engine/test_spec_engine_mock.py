"""Speculative decoding through the whole engine on the mock executor: every output (tokens, text,
finish and stop reasons) equals plain decoding's, whatever is accepted or rejected."""

from __future__ import annotations

import random

import pytest
from spec_proposers import OracleProposer, fixed_k_speculator

from kvmosaic.core.sequence_rules import fork_seed
from kvmosaic.engine.engine import Engine
from kvmosaic.executor.mock import MockExecutor
from kvmosaic.metrics import ServerMetrics
from kvmosaic.sampling_params import SamplingParams

PROMPTS = ["t1 t2 t3", "t5 t5 t5 t5 t5 t5", "t9 t8 t7 t6 t5 t4 t3 t2 t1", "t1 t2 t3 t4"]


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "max_tokens": 12, **kwargs})


def _run(engine: Engine, params: SamplingParams, prompts: list[str] = PROMPTS) -> list[list[tuple]]:
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason)
                                        for c in out.outputs]
    assert engine.stats()["kv_blocks_used"] == 0
    return [done[i] for i in ids]


def _sample_seed(request_id: str, seed: int | None) -> int | None:
    """The seed the scheduler gives sequence ``group#i`` of a request seeded with ``seed``."""
    return fork_seed(seed, int(request_id.partition("#")[2] or 0))


def _engines(seed: int = 0, params_seed: int | None = None, **executor_kwargs) -> tuple[Engine, Engine]:
    kwargs = {"num_device_blocks": 12, "block_size": 4, **executor_kwargs}
    proposer = OracleProposer(64, random.Random(seed), lambda rid: _sample_seed(rid, params_seed))
    speculator = fixed_k_speculator(proposer, k=5)
    return Engine(executor=MockExecutor(**kwargs)), Engine(executor=MockExecutor(**kwargs), speculator=speculator)


@pytest.mark.parametrize("params", [
    _greedy(),
    _greedy(stop=["t4", "t56 t"]),  # stop strings inside accepted runs
    _greedy(stop=["t12"], include_stop_str_in_output=True),
    _greedy(stop_token_ids=[48, 32]),
    _greedy(max_tokens=3),
    SamplingParams(n=2, best_of=3, temperature=1.0, seed=5, ignore_eos=True, max_tokens=10),
], ids=["greedy", "stop-strings", "stop-included", "stop-tokens", "max-tokens", "n-best-of"])
def test_speculation_changes_no_output(params):
    plain, spec = _engines(params_seed=params.seed)
    expected = _run(plain, params)
    assert _run(spec, params) == expected
    stats = spec.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    assert 1.0 < stats["spec_mean_accepted_length"] <= 6.0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_speculation_with_preemption_and_prefix_hits(mode):
    kwargs = {"num_device_blocks": 7, "preemption_mode": mode, "num_swap_blocks": 16 if mode == "swap" else 0}
    plain, spec = _engines(seed=3, **kwargs)
    params = _greedy(max_tokens=16)
    expected = _run(plain, params)
    assert _run(spec, params) == expected
    assert spec.stats()["num_preemptions"] > 0
    # one prompt alone, twice: the second run's full prompt blocks come from the prefix cache
    for _ in range(2):
        assert _run(spec, params, PROMPTS[2:3]) == expected[2:3]
    assert spec.stats()["prefix_cache_hits"] >= 8


def test_metrics_show_the_speculation_counters():
    _, spec = _engines()
    _run(spec, _greedy())
    metrics = ServerMetrics()
    metrics.set_engine_stats(spec.stats())
    text = metrics.render()[0].decode()
    accepted = spec.stats()["spec_num_accepted_tokens"]
    assert f"\nkvmosaic_spec_decode_num_accepted_tokens_total {float(accepted)}" in text
    for name in ["spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_mean_accepted_length"]:
        assert f"\nkvmosaic_{name} " in text, name
    plain = ServerMetrics()
    plain.set_engine_stats(_engines()[0].stats())
    assert "spec_decode" not in plain.render()[0].decode()
