"""Scheduler tests against a fake model runner whose arithmetic can be done by hand.

The runner is ``kvmosaic.executor.mock.MockExecutor``: it keeps a paged KV cache of
token ids, applies the step's swaps and copies, writes each scheduled token into the
slot its block table names, then reads every sampled sequence's whole context back
through its block table. A wrong table, a missed copy-on-write or a bad swap shows up
as a wrong context. The next token is ``(sum(context) + seed) % 100``, so outputs do
not depend on how the work was scheduled.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmosaic.config import SchedulerConfig
from kvmosaic.core.kv_cache_manager import KVCacheManager
from kvmosaic.core.scheduler import Scheduler
from kvmosaic.core.sequence_rules import fork_seed
from kvmosaic.executor.mock import MockExecutor
from kvmosaic.executor.mock import next_token as mock_next_token
from kvmosaic.outputs import ModelOutput, SampledToken, SchedulerOutput
from kvmosaic.request import Request, RequestStatus
from kvmosaic.sampling_params import SamplingParams

VOCAB = 100


def next_token(context: list[int], seed: int | None) -> int:
    return mock_next_token(context, seed, VOCAB)


def mock_runner(kv: KVCacheManager) -> MockExecutor:
    return MockExecutor(kv.num_blocks, kv.block_size, kv.num_host_blocks, vocab_size=VOCAB)


class ScriptedRunner:
    """Returns the i-th scripted token for a sequence's i-th output."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        self.scripts = scripts

    def execute(self, step: SchedulerOutput) -> ModelOutput:
        return ModelOutput({
            seq.request_id: SampledToken(self.scripts[seq.request_id][len(seq.output_token_ids)], 0.0)
            for seq in step.scheduled if seq.sample_ids
        })


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, num_host_blocks: int = 0, enable_prefix_caching: bool = True,
    eos_token_ids: tuple[int, ...] = (), **config,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks, enable_prefix_caching)
    return Scheduler(SchedulerConfig(**config), kv, eos_token_ids)


def make_request(request_id: str, prompt: list[int], **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(request_id, prompt, SamplingParams(**params), arrival_time=0.0)


class Harness:
    """A scheduler driven like the engine drives it, remembering every sequence (finished ones too)."""

    def __init__(self, runner=None, **scheduler_kwargs) -> None:
        self.scheduler = make_scheduler(**scheduler_kwargs)
        self.kv = self.scheduler.kv_manager
        self.runner = runner or mock_runner(self.kv)
        self.sequences: dict[str, Request] = {}

    def add(self, request_id: str, prompt: list[int], **params) -> Request:
        request = make_request(request_id, prompt, **params)
        self.sequences[request_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        output = self.scheduler.schedule()
        updated = self.scheduler.update_from_output(output, self.runner.execute(output))
        self.sequences.update((request.request_id, request) for request in updated)
        return output, updated

    def steps(self, num_steps: int) -> list[SchedulerOutput]:
        return [self.step()[0] for _ in range(num_steps)]

    def run(self, max_steps: int = 2000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return {rid: request.output_token_ids for rid, request in self.sequences.items()}
            self.step()
        raise AssertionError("requests did not finish")


def counts(output: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(seq.request_id, seq.num_tokens, bool(seq.sample_ids)) for seq in output.scheduled]


# ---------------------------------------------------------------- budgeting
def test_token_budget_and_chunked_prefill():
    h = Harness(max_num_batched_tokens=10)
    h.add("a", list(range(1, 8)), max_tokens=3)
    h.add("b", list(range(11, 19)), max_tokens=3)
    assert [counts(o) for o in h.steps(5)] == [
        [("a", 7, True), ("b", 3, False)],
        [("a", 1, True), ("b", 5, True)],
        [("a", 1, True), ("b", 1, True)],
        [("b", 1, True)],
        [],
    ]


def test_prefill_chunk_limit():
    h = Harness(long_prefill_token_threshold=4)
    h.add("a", list(range(10)), max_tokens=2)
    outputs = h.steps(4)
    assert [counts(o) for o in outputs] == [[("a", 4, False)], [("a", 4, False)], [("a", 2, True)], [("a", 1, True)]]
    assert [o.scheduled[0].start_pos for o in outputs] == [0, 4, 8, 10]
    assert outputs[1].scheduled[0].token_ids == [4, 5, 6, 7]


def test_max_num_seqs_and_fcfs():
    h = Harness(max_num_seqs=2)
    for request_id in "abc":
        h.add(request_id, [1, 2], max_tokens=2)
    assert [[seq.request_id for seq in o.scheduled] for o in h.steps(4)] == [["a", "b"], ["a", "b"], ["c"], ["c"]]
    assert not h.scheduler.has_unfinished_requests()


def test_prefix_hit_on_admission_starts_at_the_hit_boundary():
    h = Harness(block_size=2)
    h.add("a", [1, 2, 3, 4, 5], max_tokens=1)
    h.run()
    b = h.add("b", [1, 2, 3, 4, 9], max_tokens=1)
    output, _ = h.step()
    assert (output.scheduled[0].start_pos, output.scheduled[0].token_ids) == (4, [9])
    assert b.num_cached_tokens == 4
    assert h.kv.prefix_cache_stats()["hits"] == 4


# --------------------------------------------------------------- preemption
def _two_request_squeeze(**config) -> Harness:
    # 4 blocks of 2 slots; each request needs 3 blocks to finish 4 outputs from a 3-token prompt.
    h = Harness(num_blocks=4, block_size=2, **config)
    h.add("a", [1, 2, 3], max_tokens=4)
    h.add("b", [4, 5, 6], max_tokens=4)
    return h


def test_recompute_preemption_picks_the_newest_and_resumes():
    h = _two_request_squeeze()
    outputs = h.steps(5)
    assert [counts(o) for o in outputs[:4]] == [
        [("a", 3, True), ("b", 3, True)],
        [("a", 1, True), ("b", 1, True)],
        [("a", 1, True)],  # a needs a third block: b (the newest) is preempted
        [("a", 1, True)],  # b cannot come back yet: 1 free block, it needs 3
    ]
    assert [o.preempted_request_ids for o in outputs] == [[], [], ["b"], [], []]
    resumed = outputs[4].scheduled[0]
    # b recomputes prompt + 2 outputs, reusing its first block from the prefix cache.
    assert (resumed.request_id, resumed.start_pos, resumed.token_ids) == ("b", 2, [6, 15, 30])
    assert resumed.block_table == [2, 3, 1]
    assert outputs[4].finished_request_ids == {"a"}
    assert h.run() == {"a": [6, 12, 24, 48], "b": [15, 30, 60, 20]}
    assert h.sequences["b"].num_preemptions == 1 and h.scheduler.num_preemptions == 1
    assert h.sequences["b"].num_cached_tokens == 0  # counts prompt hits of the first admission only
    assert h.kv.num_free_blocks == 4


def test_recompute_without_prefix_caching_gives_the_same_outputs():
    h = _two_request_squeeze(enable_prefix_caching=False)
    assert h.run() == {"a": [6, 12, 24, 48], "b": [15, 30, 60, 20]}
    assert h.scheduler.num_preemptions == 1


def test_swap_preemption_moves_blocks_and_resumes():
    h = _two_request_squeeze(preemption_mode="swap", num_host_blocks=4)
    outputs = h.steps(5)
    assert outputs[2].preempted_request_ids == ["b"]
    assert outputs[2].blocks_to_swap_out == [(2, 0), (3, 1)]
    assert counts(outputs[3]) == [("a", 1, True)]  # no room to swap b back while a runs
    assert outputs[4].blocks_to_swap_in == [(0, 2), (1, 3)]
    resumed = outputs[4].scheduled[0]
    assert (resumed.request_id, resumed.start_pos, resumed.token_ids, resumed.block_table) == ("b", 4, [30], [2, 3, 1])
    assert h.run() == {"a": [6, 12, 24, 48], "b": [15, 30, 60, 20]}
    assert h.kv.num_free_host_blocks == 4 and h.kv.num_free_blocks == 4


def test_swap_falls_back_to_recompute_when_the_host_is_full():
    h = _two_request_squeeze(preemption_mode="swap", num_host_blocks=1)
    outputs = h.steps(3)
    assert outputs[2].preempted_request_ids == ["b"] and outputs[2].blocks_to_swap_out == []
    assert h.sequences["b"].status == RequestStatus.PREEMPTED
    assert h.run() == {"a": [6, 12, 24, 48], "b": [15, 30, 60, 20]}


def test_self_preemption_when_the_newest_is_the_one_scheduled():
    # 3 blocks of 2 slots, one per request; a's growth preempts c, then b has to preempt itself.
    h = Harness(num_blocks=3, block_size=2)
    for request_id, prompt in (("a", [1]), ("b", [2]), ("c", [3])):
        h.add(request_id, prompt, max_tokens=3)
    output = h.steps(3)[2]
    assert output.preempted_request_ids == ["c", "b"]
    assert counts(output) == [("a", 1, True)]
    assert [r.request_id for r in h.scheduler.waiting] == ["b", "c"]
    assert h.run() == {"a": [1, 2, 4], "b": [2, 4, 8], "c": [3, 6, 12]}


# ----------------------------------------------------------------- forking
def test_n3_forks_share_blocks_and_copy_on_write():
    h = Harness(num_blocks=16, block_size=4)
    h.add("g", [1, 2, 3, 4, 5, 6], n=3, temperature=1.0, seed=5, max_tokens=3)
    first, updated = h.step()
    assert first.scheduled[0].sample_ids == ["g", "g#1", "g#2"]
    assert first.scheduled[0].sample_seeds == [5, 5 + 0x9E3779B1, 5 + 2 * 0x9E3779B1]
    assert [r.request_id for r in updated] == ["g", "g#1", "g#2"]
    assert [r.request_id for r in h.scheduler.running] == ["g", "g#1", "g#2"]
    second, _ = h.step()
    assert second.blocks_to_copy == [(1, 2), (1, 3)]
    assert [seq.block_table for seq in second.scheduled] == [[0, 2], [0, 3], [0, 1]]
    assert h.run() == {"g": [26, 52, 4], "g#1": [87, 74, 48], "g#2": [48, 96, 92]}
    assert h.sequences["g#2"].sample_index == 2 and h.sequences["g#2"].group_id == "g"
    assert h.kv.num_free_blocks == 16


def test_forks_under_memory_pressure_match_the_unconstrained_run():
    outputs = []
    for num_blocks in (64, 4):
        h = Harness(num_blocks=num_blocks, block_size=2)
        h.add("g", [1, 2, 3], n=3, temperature=1.0, seed=1, max_tokens=4)
        outputs.append(h.run())
    assert outputs[0] == outputs[1]
    assert h.scheduler.num_preemptions > 0


def test_fork_seed():
    assert fork_seed(None, 1) is None
    assert fork_seed(2**63 - 1, 1) == (2**63 - 1 + 0x9E3779B1) % 2**63


# ------------------------------------------------------------------- stops
@pytest.mark.parametrize(("params", "script", "expected", "status", "stop_reason"), [
    ({"ignore_eos": False}, [5, 0, 7], [5, 0], RequestStatus.FINISHED_STOPPED, None),
    ({"ignore_eos": True, "max_tokens": 3}, [5, 0, 7], [5, 0, 7], RequestStatus.FINISHED_LENGTH, None),
    ({"ignore_eos": False, "min_tokens": 2}, [0, 0, 0, 9], [0, 0, 0], RequestStatus.FINISHED_STOPPED, None),
    ({"stop_token_ids": [7], "min_tokens": 1}, [7, 5, 7, 9], [7, 5, 7], RequestStatus.FINISHED_STOPPED, 7),
    ({"max_tokens": 2}, [5, 6, 7], [5, 6], RequestStatus.FINISHED_LENGTH, None),
    ({"max_tokens": None}, [1, 2, 3, 4], [1, 2], RequestStatus.FINISHED_LENGTH, None),  # max_model_len 6
])
def test_stop_conditions(params, script, expected, status, stop_reason):
    max_model_len = 6 if params.get("max_tokens", 16) is None else 100
    h = Harness(ScriptedRunner({"a": script}), eos_token_ids=(0,), max_model_len=max_model_len)
    sequence = h.add("a", [1, 2, 3, 4], **params)
    assert h.run()["a"] == expected
    assert (sequence.status, sequence.stop_reason) == (status, stop_reason)
    assert h.kv.num_free_blocks == h.kv.num_blocks


# ------------------------------------------------------- abort and capacity
def test_abort_frees_blocks_in_every_queue():
    h = Harness(num_blocks=4, block_size=2, preemption_mode="swap", num_host_blocks=4)
    a, b, c = h.add("a", [1, 2, 3], max_tokens=4), h.add("b", [4, 5, 6], max_tokens=4), h.add("c", [7], max_tokens=4)
    h.steps(3)
    assert [r.status for r in (a, b, c)] == [RequestStatus.RUNNING, RequestStatus.SWAPPED, RequestStatus.WAITING]
    h.scheduler.finish_requests(["a", "b", "c", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not h.scheduler.has_unfinished_requests()
    assert h.kv.num_free_blocks == 4 and h.kv.num_free_host_blocks == 4
    output = h.scheduler.schedule()
    assert output.finished_request_ids == {"a", "b", "c"} and output.is_empty
    with pytest.raises(ValueError):
        h.scheduler.finish_requests("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_ignored():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2]))
    output = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert scheduler.update_from_output(output, mock_runner(scheduler.kv_manager).execute(output)) == []
    assert scheduler.kv_manager.num_used_blocks == 0


def test_prompt_that_can_never_fit_is_aborted():
    h = Harness(num_blocks=2, block_size=2, max_model_len=100)
    assert h.scheduler.can_ever_fit(4) and not h.scheduler.can_ever_fit(5)
    big = h.add("big", [1, 2, 3, 4, 5])
    h.add("ok", [1, 2], max_tokens=1)
    output, updated = h.step()
    assert counts(output) == [("ok", 2, True)]
    assert updated == [h.sequences["ok"], big]
    assert big.status == RequestStatus.FINISHED_ABORTED and "never fit" in big.stop_reason
    assert not h.scheduler.has_unfinished_requests()
    assert not make_scheduler(max_model_len=8).can_ever_fit(9)


def test_sequence_outgrowing_the_whole_pool_finishes_by_length():
    h = Harness(num_blocks=2, block_size=2)
    a = h.add("a", [1, 2, 3], max_tokens=10)
    assert h.run() == {"a": [6, 12]}  # the 4 slots hold the prompt and the first output
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert h.kv.num_free_blocks == 2


# ---------------------------------------------------------------- property
@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    specs = []
    for index in range(draw(st.integers(1, 6))):
        shared = draw(st.sampled_from([[], [7, 8, 9], [7, 8, 9, 10, 11]]))
        prompt = shared + draw(st.lists(st.integers(1, 99), min_size=1, max_size=8))
        n = draw(st.sampled_from([1, 1, 2, 3]))
        params = dict(
            n=n, temperature=1.0, seed=draw(st.one_of(st.none(), st.integers(0, 1000))) if n == 1 else index,
            max_tokens=draw(st.integers(1, 6)), min_tokens=draw(st.integers(0, 1)),
            ignore_eos=draw(st.booleans()), stop_token_ids=draw(st.sampled_from([[], [50]])),
        )
        specs.append((f"r{index}", prompt, params, draw(st.integers(0, 6))))  # (id, prompt, params, arrival step)
    longest = max(len(prompt) + params["max_tokens"] for _, prompt, params, _ in specs)
    min_blocks = -(-longest // block_size)
    config = dict(
        num_blocks=min_blocks + draw(st.integers(0, 6)), block_size=block_size,
        num_host_blocks=draw(st.integers(0, 12)), enable_prefix_caching=draw(st.booleans()),
        max_num_batched_tokens=draw(st.integers(1, 16)), long_prefill_token_threshold=draw(st.integers(0, 5)),
        max_num_seqs=draw(st.integers(1, 6)), preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
    )
    return specs, config


def _run_workload(specs, config) -> dict[str, tuple[list[int], RequestStatus]]:
    h = Harness(eos_token_ids=(0,), max_model_len=1000, **config)
    for step_index in range(3000):
        for request_id, prompt, params, arrival in specs:
            if arrival == step_index:
                h.add(request_id, prompt, **params)
        if step_index > 6 and not h.scheduler.has_unfinished_requests():
            break
        output, _ = h.step()
        assert output.num_batched_tokens <= config["max_num_batched_tokens"]
        assert all(seq.num_tokens <= h.scheduler.config.prefill_chunk for seq in output.scheduled)
        assert len(output.scheduled) <= max(config["max_num_seqs"], 3)  # only a lone n=3 group may exceed it
    else:
        raise AssertionError("workload did not finish")
    assert h.kv.num_used_blocks == 0 and h.kv.num_free_blocks == h.kv.num_blocks
    assert all(h.kv.ref_count(block_id) == 0 for block_id in range(h.kv.num_blocks))
    assert h.kv.num_free_host_blocks == h.kv.num_host_blocks
    return {rid: (s.output_token_ids, s.status) for rid, s in h.sequences.items()}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_any_workload_finishes_with_the_unconstrained_outputs(workload):
    specs, config = workload
    unconstrained = dict(config, num_blocks=1000, num_host_blocks=0, max_num_batched_tokens=1000,
                         long_prefill_token_threshold=0, max_num_seqs=100, preemption_mode="recompute")
    assert _run_workload(specs, config) == _run_workload(specs, unconstrained)
