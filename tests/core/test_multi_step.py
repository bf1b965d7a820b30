"""Multi-step decoding (``num_scheduler_steps``) through the mock executor, whose tokens can be worked
out by hand (next token = (sum of the context + seed) % 64) and which checks, pass by pass, that the
cache holds exactly the sequence's tokens: a wrong slot or a token fed back twice is a KVMismatch."""

from __future__ import annotations

import pytest

from kvmosaic.config import EngineConfig, SchedulerConfig
from kvmosaic.config_spec import SpeculativeConfig
from kvmosaic.engine.engine import Engine
from kvmosaic.executor.mock import MockExecutor
from kvmosaic.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)


def run(engine: Engine, requests: list[tuple[str, SamplingParams]],
        arrivals: dict[int, list[tuple[str, SamplingParams]]] | None = None) -> list[list[list[int]]]:
    """Every request's outputs (per sample), with ``arrivals[step]`` added before that engine step."""
    ids = [engine.add_request(None, p, sp) for p, sp in requests]
    done: dict[str, list[list[int]]] = {}
    step = 0
    while engine.has_unfinished() or (arrivals and any(s >= step for s in arrivals)):
        for p, sp in (arrivals or {}).get(step, []):
            ids.append(engine.add_request(None, p, sp))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        step += 1
    return [done[i] for i in ids]


def test_a_decode_step_runs_its_passes_in_the_slots_reserved_for_them():
    """[1, 2, 3] doubles its running sum: 6, 12, 24, 48. The prompt step runs one pass; the next
    step runs the three tokens left in one go, in block 0's last slot and block 1's first two."""
    executor = MockExecutor(num_device_blocks=8, block_size=4, num_scheduler_steps=4)
    engine = Engine(executor=executor)
    assert run(engine, [("t1 t2 t3", GREEDY)]) == [[[6, 12, 24, 48]]]
    steps = [[(s.token_ids, s.start_pos, s.block_table, s.num_steps) for s in o.scheduled] for o in executor.steps]
    assert steps == [[([1, 2, 3], 0, [0], 1)], [([6], 3, [0, 1], 3)]]
    assert executor.device[0] == [1, 2, 3, 6] and executor.device[1][:2] == [12, 24]
    assert engine.stats()["kv_blocks_used"] == 0


def test_passes_stop_at_max_tokens_and_the_context_length():
    """Each step's passes never outrun max_tokens (nor max_model_len): 10 outputs at 4 passes a step."""
    executor = MockExecutor(num_device_blocks=16, block_size=4, num_scheduler_steps=4)
    engine = Engine(executor=executor)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)
    (tokens,), = run(engine, [("t1 t2 t3", params)])
    assert len(tokens) == 10
    assert [s.scheduled[0].num_steps for s in executor.steps] == [1, 4, 4, 1]
    short = MockExecutor(num_device_blocks=16, block_size=4, num_scheduler_steps=4, max_model_len=9)
    unbounded = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None)
    (tokens,), = run(Engine(executor=short), [("t1 t2 t3", unbounded)])
    assert len(tokens) == 6  # 3 prompt + 6 outputs = max_model_len
    assert [s.scheduled[0].num_steps for s in short.steps] == [1, 4, 1]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("num_steps", [2, 3, 8])
def test_outputs_equal_single_pass_steps(num_steps, preemption_mode):
    """Mixed requests arriving at different steps, in a pool small enough to preempt: stop tokens,
    min_tokens, seeds, n > 1 and max_tokens give every sequence the same tokens as one pass a step."""
    requests = [
        ("t1 t2 t3", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)),
        ("t5 t0 t0 t0 t1", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=9, stop_token_ids=[24])),
        ("t2 t2", SamplingParams(temperature=0.9, seed=3, max_tokens=7, n=2)),
    ]
    arrivals = {3: [("t7 t1", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=11, min_tokens=4,
                                             stop_token_ids=[0]))],
                5: [("t3", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5))]}

    def outputs(steps: int) -> list[list[list[int]]]:
        executor = MockExecutor(num_device_blocks=7, block_size=4, num_swap_blocks=16,
                                preemption_mode=preemption_mode, num_scheduler_steps=steps)
        engine = Engine(executor=executor)
        result = run(engine, requests, arrivals)
        assert engine.stats()["kv_blocks_used"] == 0
        return result, executor.steps

    expected, single = outputs(1)
    got, multi = outputs(num_steps)
    assert got == expected
    assert expected[1] == [[6, 12, 24]]  # the stop token ends it before max_tokens
    assert expected[3] == [[8, 16, 32, 0, 0]]  # the first 0 comes within min_tokens, the second stops it
    assert len(multi) < len(single)
    assert max(s.num_steps for o in multi for s in o.scheduled) == num_steps
    for o in multi:  # several passes only in steps where every sequence decodes one token
        if any(s.num_steps > 1 for s in o.scheduled):
            assert all(s.num_tokens == 1 and not o.kv_loads for s in o.scheduled)
            assert not (o.blocks_to_swap_in or o.blocks_to_swap_out or o.preempted_request_ids)


def test_a_step_that_admits_a_prompt_runs_one_pass():
    executor = MockExecutor(num_device_blocks=16, block_size=4, num_scheduler_steps=4)
    engine = Engine(executor=executor)
    run(engine, [("t1 t2 t3", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12))],
        {2: [("t4 t4", GREEDY)]})
    admitting = next(o for o in executor.steps if any(s.num_tokens > 1 for s in o.scheduled[1:]))
    assert [s.num_steps for s in admitting.scheduled] == [1, 1]


def test_extra_passes_take_only_free_blocks_and_never_preempt():
    """Two sequences in 3 blocks of 4: the first takes the last free block for its extra passes, so
    the second runs one pass (its slot is in its own block) instead of preempting anyone; one pass
    a step instead preempts the second when both need a block at position 4."""
    requests = [("t1 t2 t3", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5)),
                ("t2 t3 t4", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5))]
    single, multi = (MockExecutor(num_device_blocks=3, block_size=4, num_scheduler_steps=n) for n in (1, 8))
    engines = Engine(executor=single), Engine(executor=multi)
    assert run(engines[1], requests) == run(engines[0], requests)
    assert (engines[0].scheduler.num_preemptions, engines[1].scheduler.num_preemptions) == (1, 0)
    steps = [[(s.start_pos, s.block_table, s.num_steps) for s in o.scheduled] for o in multi.steps]
    assert steps == [[(0, [0], 1), (0, [1], 1)], [(3, [0, 2], 4), (3, [1], 1)], [(4, [1, 2], 3)]]


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=65)
    with pytest.raises(ValueError, match="cannot be combined"):
        EngineConfig(scheduler=SchedulerConfig(num_scheduler_steps=4),
                     speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2))
