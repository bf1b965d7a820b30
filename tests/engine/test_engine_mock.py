"""The engine, scheduler and KV manager driven through a mock executor whose tokens can be worked
out by hand: next token = (sum of the context's token ids + seed) % 64 (kvmosaic.executor.mock)."""

from __future__ import annotations

import dataclasses

import pytest

from kvmosaic.engine.engine import Engine
from kvmosaic.executor.mock import MockExecutor
from kvmosaic.outputs import ModelOutput, SchedulerOutput
from kvmosaic.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
# [1, 2, 3] -> 6 (sum 6), then 12 (sum 12), 24, 48: each token doubles the running sum
DOUBLING = [6, 12, 24, 48]


def run(engine: Engine, prompts: list[str], params: SamplingParams = GREEDY) -> dict[str, list[list[int]]]:
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return {rid: done[rid] for rid in ids}


def test_greedy_tokens_and_text_are_the_hand_computed_ones():
    engine = Engine(executor=MockExecutor(num_device_blocks=8, block_size=4))
    rid = engine.add_request(None, "t1 t2 t3", GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    final = outs[-1]
    assert final.request_id == rid and final.finished
    assert final.outputs[0].token_ids == DOUBLING
    assert final.outputs[0].text == " t6 t12 t24 t48"
    assert final.outputs[0].finish_reason == "length"
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_leaves_every_output_unchanged(mode):
    """Three requests of 4 + 8 tokens in a pool of 5 blocks of 4: they cannot all grow, so the
    newest is preempted (recomputed, or swapped to 8 host blocks and back) and still gets the same tokens."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    prompts = ["t1 t2 t3 t4", "t2 t2 t2 t2", "t5 t0 t0 t0"]
    # "t1 t2 t3 t4" sums to 10: 10, 20, 40, 80 % 64 = 16, then the sum is 96 -> 32, 128 -> 0, 0, 0
    expected = []
    for prompt in prompts:
        context = [int(t[1:]) for t in prompt.split()]
        tokens = []
        for _ in range(8):
            tokens.append(sum(context) % 64)
            context.append(tokens[-1])
        expected.append([tokens])
    assert expected[0] == [[10, 20, 40, 16, 32, 0, 0, 0]]
    executor = MockExecutor(num_device_blocks=5, block_size=4, num_swap_blocks=8 if mode == "swap" else 0,
                            preemption_mode=mode)
    engine = Engine(executor=executor)
    assert list(run(engine, prompts, params).values()) == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0
    swapped = any(step.blocks_to_swap_out for step in executor.steps)
    assert swapped == (mode == "swap")


def test_prefix_hit_skips_the_cached_blocks_and_gives_the_same_tokens():
    executor = MockExecutor(num_device_blocks=16, block_size=4)
    engine = Engine(executor=executor)
    shared = "t1 t2 t3 t4 t5 t6 t7 t8"  # two full blocks
    first = run(engine, [shared + " t9 t10"])
    steps_before = len(executor.steps)
    second_id = engine.add_request(None, shared + " t11", GREEDY)
    out = None
    while engine.has_unfinished():
        out = next((o for o in engine.step() if o.finished), out)
    assert out.request_id == second_id
    # 36 + 11 = 47, then 94 % 64 = 30, 60, 120 % 64 = 56
    assert out.outputs[0].token_ids == [47, 30, 60, 56]
    assert list(first.values()) == [[[55, 46, 28, 56]]]  # 55 = 1 + ... + 10, then 110 % 64 = 46, ...
    assert out.metrics.num_cached_tokens == 8
    prefill = executor.steps[steps_before].scheduled[0]
    assert (prefill.start_pos, prefill.token_ids) == (8, [11])  # only the uncached token runs
    assert prefill.block_table[:2] == executor.steps[0].scheduled[0].block_table[:2]  # the same blocks


def test_n_samples_fork_the_prompt_and_copy_the_shared_partial_block():
    """n=3 with seed 0: the siblings' seeds are 0, 0x9E3779B1 and 2 * 0x9E3779B1, which are 0, 49
    and 34 mod 64; the 3-token prompt's block is shared, so the first write into it copies it."""
    executor = MockExecutor(num_device_blocks=8, block_size=4)
    engine = Engine(executor=executor)
    params = SamplingParams(n=3, seed=0, temperature=1.0, ignore_eos=True, max_tokens=2)
    (samples,) = run(engine, ["t1 t2 t3"], params).values()
    # sum 6: 6, 6 + 49 = 55, 6 + 34 = 40; then [1,2,3,6] -> 12, [1,2,3,55] 61 + 49 = 110 % 64 = 46,
    # [1,2,3,40] 46 + 34 = 80 % 64 = 16
    assert samples == [[6, 12], [55, 46], [40, 16]]
    assert any(step.blocks_to_copy for step in executor.steps)
    assert engine.stats()["kv_blocks_used"] == 0


class FailingOnce(MockExecutor):
    """Raises in its ``fail_at``-th step (0-based), as a broken kernel would."""

    def __init__(self, fail_at: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_at = fail_at

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        if len(self.steps) == self.fail_at:
            self.steps.append(sched)
            raise RuntimeError("kernel exploded")
        return super().execute(sched)


def test_a_failing_step_ends_its_requests_with_an_error_and_the_engine_goes_on():
    engine = Engine(executor=FailingOnce(1, num_device_blocks=8, block_size=4))
    rid = engine.add_request(None, "t1 t2 t3", GREEDY)
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    (failed,) = finals
    assert failed.request_id == rid and failed.outputs[0].finish_reason == "abort"
    assert "kernel exploded" in failed.outputs[0].stop_reason
    assert failed.outputs[0].token_ids == [6]  # the token of the step before the failure
    assert engine.stats()["kv_blocks_used"] == 0
    # the failed step's blocks were indexed by hash but may hold half-written K/V: not reused
    again = run(engine, ["t1 t2 t3 t4 t5"], dataclasses.replace(GREEDY, max_tokens=2))
    assert list(again.values()) == [[[15, 30]]]


@pytest.mark.parametrize("prompt", ["\ud800 lone surrogate", "", [64], [-1]])
def test_bad_prompts_are_value_errors_and_leave_the_engine_untouched(prompt):
    engine = Engine(executor=MockExecutor(num_device_blocks=8, block_size=4))
    with pytest.raises(ValueError):
        engine.add_request(None, prompt, GREEDY)
    assert not engine.has_unfinished()
    assert list(run(engine, ["t1 t2 t3"]).values()) == [[DOUBLING]]
