"""Speculative tokens in the scheduler and KV manager, against the mock executor: budget, rollback
with exact block ids, and no leaked blocks over many random accept/reject steps."""

from __future__ import annotations

import random

import pytest
from spec_proposers import OracleProposer, ScriptedProposer, fixed_k_speculator

from kvmosaic.config import SchedulerConfig
from kvmosaic.core.kv_cache_manager import KVCacheManager
from kvmosaic.core.scheduler import Scheduler
from kvmosaic.executor.mock import MockExecutor, next_token
from kvmosaic.request import Request, RequestStatus
from kvmosaic.sampling_params import SamplingParams

VOCAB = 64


def _scheduler(proposer, num_blocks=8, block_size=4, num_host_blocks=0, k=4, **config):
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks)
    config.setdefault("max_model_len", 256)
    scheduler = Scheduler(SchedulerConfig(**config), kv, (), fixed_k_speculator(proposer, k))
    return scheduler, MockExecutor(num_blocks, block_size, num_host_blocks, vocab_size=VOCAB)


def _request(request_id, prompt, max_tokens=16, **params):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **params)
    return Request(request_id, prompt, params, arrival_time=0.0)


def _step(scheduler, executor):
    out = scheduler.schedule()
    scheduler.update_from_output(out, executor.execute(out))
    return out


def _greedy_tokens(prompt, n):
    context, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(context, 0, VOCAB))
        context.append(out[-1])
    return out


def test_rejected_tail_past_a_block_boundary_frees_its_block():
    truth = _greedy_tokens([1, 2, 3, 4, 5], 8)
    wrong = (truth[2] + 1) % VOCAB
    # step 2 proposes 4 tokens of which the first is right; step 3 proposes 3 right ones
    proposer = ScriptedProposer([[truth[1], wrong, 0, 0], truth[3:6]])
    scheduler, executor = _scheduler(proposer)
    request = _request("a", [1, 2, 3, 4, 5])
    scheduler.add_request(request)
    _step(scheduler, executor)  # prefill: 5 tokens in blocks [0, 1]
    assert scheduler.kv_manager.get_block_table("a") == [0, 1]
    verify = _step(scheduler, executor).scheduled[0]
    # the last token (position 5) and 4 proposals (6..9) needed a third block
    assert (verify.start_pos, verify.num_tokens, verify.block_table) == (5, 5, [0, 1, 2])
    # accepted: the first proposal; computed: positions 0..6, so block 2 held only rejected tokens
    assert request.output_token_ids == truth[:3]
    assert request.num_computed_tokens == 7
    assert scheduler.kv_manager.get_block_table("a") == [0, 1]
    assert scheduler.kv_manager.num_free_blocks == 6
    verify = _step(scheduler, executor).scheduled[0]
    # block 2 was freed without a cached prefix: it is the first block taken again
    assert (verify.start_pos, verify.num_tokens, verify.block_table) == (7, 4, [0, 1, 2])
    # all three accepted, plus the bonus token: 4 new tokens, positions 0..10 computed
    assert request.output_token_ids == truth[:7]
    assert request.num_computed_tokens == 11
    assert scheduler.kv_manager.get_block_table("a") == [0, 1, 2]


def test_proposals_share_the_budget_and_leave_a_token_for_every_later_sequence():
    proposer = ScriptedProposer([[9] * 4] * 4)
    scheduler, executor = _scheduler(proposer, num_blocks=16, max_num_batched_tokens=6)
    for rid in "ab":
        scheduler.add_request(_request(rid, [1, 2]))
    _step(scheduler, executor)
    step = _step(scheduler, executor)
    assert [(s.request_id, s.num_tokens, len(s.spec_token_ids)) for s in step.scheduled] == [("a", 5, 4), ("b", 1, 0)]


def test_proposals_never_preempt():
    # 2 blocks of 4: the prompt and first output fill 4 slots; a proposal would need a third block
    proposer = ScriptedProposer([[9, 9]] * 8)
    scheduler, executor = _scheduler(proposer, num_blocks=2)
    scheduler.add_request(_request("a", [1, 2, 3], max_tokens=5))
    for _ in range(3):
        _step(scheduler, executor)
    assert scheduler.num_preemptions == 0
    assert scheduler.requests["a"].output_token_ids == _greedy_tokens([1, 2, 3], 3)


def test_proposals_stop_at_max_tokens():
    proposer = OracleProposer(VOCAB)
    scheduler, executor = _scheduler(proposer, num_blocks=16, k=8)
    request = _request("a", [1, 2, 3], max_tokens=6)
    scheduler.add_request(request)
    steps = [_step(scheduler, executor) for _ in range(2)]
    # one output after the prefill: at most 6 - 1 - 1 proposals, all accepted, plus the bonus token
    assert len(steps[1].scheduled[0].spec_token_ids) == 4
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == _greedy_tokens([1, 2, 3], 6)
    assert proposer.freed == ["a"]


@pytest.mark.parametrize("mode, budget", [("recompute", 2048), ("swap", 2048), ("recompute", 10)],
                         ids=["recompute", "swap", "chunked"])
def test_random_rejections_leak_no_block_and_change_no_token(mode, budget):
    """About 1,000 steps of random accept/reject in a pool too small for everyone (preemption),
    prefix hits from repeated prompts, chunked prefills sharing a small budget with proposals: after
    every step each running table holds exactly the blocks its computed tokens need, the pool's used
    blocks are exactly those in tables, and outputs equal plain decoding's."""
    rng = random.Random(0)
    scheduler, executor = _scheduler(OracleProposer(VOCAB, rng), num_blocks=14, block_size=4,
                                     num_host_blocks=32 if mode == "swap" else 0, preemption_mode=mode, k=6,
                                     max_num_batched_tokens=budget, long_prefill_token_threshold=min(budget, 6))
    kv = scheduler.kv_manager
    num_steps, requests = 0, []
    while num_steps < 1000:
        for i in range(4):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))] if i else [7, 7, 7, 7, 7]
            requests.append(_request(f"r{len(requests)}", prompt, max_tokens=rng.randint(1, 24)))
            scheduler.add_request(requests[-1])
        while scheduler.has_unfinished_requests():
            _step(scheduler, executor)
            num_steps += 1
            tables = {r.request_id: kv.get_block_table(r.request_id) for r in scheduler.running}
            for r in scheduler.running:
                assert len(tables[r.request_id]) == -(-r.num_computed_tokens // kv.block_size), r
            assert kv.num_used_blocks == len({b for t in tables.values() for b in t})
    assert kv.num_used_blocks == 0
    assert scheduler.num_preemptions > 0
    assert scheduler.speculator.stats.num_accepted_tokens > 0
    assert scheduler.speculator.stats.num_draft_tokens > scheduler.speculator.stats.num_accepted_tokens
    for r in requests:
        assert r.output_token_ids == _greedy_tokens(r.prompt_token_ids, r.sampling_params.max_tokens)
