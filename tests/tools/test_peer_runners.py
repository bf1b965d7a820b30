"""The peers benchmark's shared measurement (benchmarks/peer_runners/common.py) on a fake engine and
a fake clock: which prompts each timed run gets and which run is reported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "peer_runners"))
import common  # noqa: E402


class FakeEngine:
    """Each generate call takes the next of `durations` seconds on the fake clock and answers every
    prompt with its first token repeated max_tokens times (or `short` tokens when set)."""

    def __init__(self, clock: list[float], durations: list[float], short: int | None = None):
        self.clock, self.durations, self.short, self.calls = clock, list(durations), short, []

    def generate(self, prompts, max_tokens):
        self.calls.append(prompts)
        self.clock[0] += self.durations.pop(0)
        n = max_tokens if self.short is None else self.short
        return [[p[0]] * n for p in prompts]


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    return now


def test_c_keeps_the_fastest_of_three_runs_on_different_prompts(clock):
    work = common.WORKLOADS["C"]
    engine = FakeEngine(clock, [9.0, 3.0, 2.0, 2.5])  # warm-up, then three timed runs
    result = common.measure(engine, work)
    timed = engine.calls[1:]
    assert len(timed) == work.timed_runs == 3
    assert timed[0] == common.workload_prompts(work)  # run 0: the prompts every engine compares on
    assert len({tuple(map(tuple, prompts)) for prompts in timed}) == 3
    assert all(len(p) == work.num_prompts and len(p[0]) == work.prompt_len for p in timed)
    assert result["run_seconds"] == [3.0, 2.0, 2.5] and result["seconds"] == 2.0
    assert result["tokens_per_s"] == 16 * 512 / 2.0
    assert result["first_tokens"] == [timed[0][0][0]]


def test_b_times_one_run(clock):
    engine = FakeEngine(clock, [1.0, 4.0])
    result = common.measure(engine, common.WORKLOADS["B"])
    assert len(engine.calls) == 2 and result["run_seconds"] == [4.0]
    assert result["tokens_per_s"] == 64 * 128 / 4.0


def test_a_run_with_missing_tokens_is_an_error(clock):
    engine = FakeEngine(clock, [1.0, 1.0, 1.0, 1.0], short=0)
    with pytest.raises(RuntimeError, match="wrong lengths"):
        common.measure(engine, common.WORKLOADS["C"])


def test_every_engine_names_a_runner_script_that_exists():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from peer_runners.engines import ENGINES, capped

    for engine in ENGINES:
        assert engine.runner.is_file(), engine.runner
        assert engine.runner.name == f"{engine.key}_runner.py"
        if (cap := capped(engine)) is not None:
            assert cap.runner == engine.runner
