"""The measured cost of a verified token (kvmosaic/core/speculation/step_cost.py) and adaptive k following it."""

import pytest
from spec_proposers import ScriptedProposer

from kvmosaic.config_spec import SpeculativeConfig
from kvmosaic.core.spec_steps import SpeculationSteps
from kvmosaic.core.speculation.speculator import Speculator
from kvmosaic.core.speculation.step_cost import SPIKE, DraftCost, StepCost
from kvmosaic.outputs import ScheduledRequest
from kvmosaic.sampling_params import SamplingParams


def test_line_through_exact_steps():
    cost = StepCost()
    for tokens in (1, 9, 1, 5, 16, 1):  # 4 ms of weights, 0.8 ms a token
        cost.observe(tokens, 0.004 + 0.0008 * tokens)
    weights, per_token = cost.line()
    assert weights == pytest.approx(0.004) and per_token == pytest.approx(0.0008)
    assert cost.token_cost(prior=0.1) == pytest.approx(0.2)


def test_prior_until_the_token_counts_spread():
    cost = StepCost()
    assert cost.token_cost(prior=0.1) == 0.1
    for _ in range(50):
        cost.observe(1, 0.006)  # plain single-stream decoding says nothing about the slope
    assert cost.line() is None and cost.token_cost(prior=0.1) == 0.1
    cost.observe(9, 0.004 + 9 * 0.002)  # one verification step: 4 ms of weights, 2 ms a token
    assert cost.token_cost(prior=0.1) == pytest.approx(0.5)


def test_a_line_that_is_no_cost_falls_back_or_clamps():
    falling = StepCost()
    for tokens in (1, 9, 1, 9):
        falling.observe(tokens, 0.01 - 0.001 * tokens)  # more tokens, faster: noise, not a cost
    assert falling.token_cost(prior=0.1) == 0.0
    negative = StepCost()
    for tokens in (4, 8, 4, 8):
        negative.observe(tokens, 0.001 * tokens - 0.003)  # intercept below zero
    assert negative.token_cost(prior=0.1) == 0.1


def test_old_steps_fade():
    cost = StepCost()
    for _ in range(20):
        for tokens in (1, 9):
            cost.observe(tokens, 0.004 + 0.0004 * tokens)  # r = 0.1
    for _ in range(200):
        for tokens in (1, 9):
            cost.observe(tokens, 0.004 + 0.004 * tokens)  # r = 1.0 now (e.g. a slower draft)
    assert cost.token_cost(prior=0.1) == pytest.approx(1.0, rel=1e-3)


def _k(speculator: Speculator, batch_size: int = 1) -> int:
    return speculator._k("a", speculator._threshold(batch_size), False)


def test_measured_cost_sets_k():
    """Unknown acceptance (1/2) at batch 1: with the prior 0.1 the threshold is 0.1 / 1.1 and k = 3;
    steps costing 0.5 of the weights' time per token make it 0.5 / 1.5, so k = 1; nearly free tokens
    (0.01) make it 0.0099, so k = 6 (0.5 ** 6 = 0.0156 > 0.0099 > 0.5 ** 7)."""
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=8), ScriptedProposer([]))
    fixed = Speculator(SpeculativeConfig(num_speculative_tokens=8, token_cost=0.1), ScriptedProposer([]))
    assert _k(speculator) == 3 and _k(fixed) == 3
    for tokens in (1, 9, 1, 9):
        speculator.observe_step(tokens, 0.004 + 0.002 * tokens)
        fixed.observe_step(tokens, 0.004 + 0.002 * tokens)
    assert speculator.token_cost() == pytest.approx(0.5) and _k(speculator) == 1
    assert fixed.token_cost() == 0.1 and _k(fixed) == 3  # a configured cost is kept
    cheap = Speculator(SpeculativeConfig(num_speculative_tokens=8), ScriptedProposer([]))
    for tokens in (1, 9, 1, 9):
        cheap.observe_step(tokens, 0.004 + 0.00004 * tokens)
    assert cheap.token_cost() == pytest.approx(0.01) and _k(cheap) == 6


def test_draft_pass_cost_shortens_k():
    """A draft pass costing c of the target's weights time raises the threshold to (B r + c) / (1 + B r).
    With r = 0.01: before any pass is timed c is the prior 0.3, 0.31 / 1.01 at batch 1, so k = 1;
    passes timed at 0.2 of T_weights give 0.21 / 1.01, so k = 2 (0.25 > 0.208 > 0.125). Batch 16 is
    another class of batch sizes with nothing timed: the nearest class seen (batch 1) prices it,
    (0.16 + 0.2) / 1.16 = 0.31, k = 1; a configured draft_cost is kept; the n-gram proposer has no
    draft cost."""
    drafted = Speculator(SpeculativeConfig(method="self", num_speculative_tokens=8), ScriptedProposer([]))
    fixed = Speculator(SpeculativeConfig(method="self", num_speculative_tokens=8, draft_cost=0.0),
                       ScriptedProposer([]))
    ngram = Speculator(SpeculativeConfig(num_speculative_tokens=8), ScriptedProposer([]))
    for speculator in (drafted, fixed, ngram):
        for tokens in (1, 9, 1, 9):
            speculator.observe_step(tokens, 0.004 + 0.00004 * tokens)
    assert drafted.token_cost() == pytest.approx(0.01) and drafted.draft_cost() == 0.3 and _k(drafted) == 1
    drafted.observe_draft(4, 4 * 0.0008)
    assert drafted.draft_cost() == pytest.approx(0.2) and _k(drafted) == 2 and _k(drafted, 16) == 1
    assert fixed.draft_cost() == 0.0 and _k(fixed) == 6 and ngram.draft_cost() == 0.0 and _k(ngram) == 6


def test_draft_passes_are_timed_apart():
    """Seconds per drafting pass; a step whose draft only mirrored (no pass drafted) is not counted."""
    speculator = Speculator(SpeculativeConfig(method="self", num_speculative_tokens=4), ScriptedProposer([]))
    steps = SpeculationSteps(speculator, kv_manager=None, max_model_len=64)
    steps.observe_draft([], 0, 0.5)  # mirroring only: no drafting pass to time
    steps.observe_draft([], 2, 0.002)
    assert speculator.costs.draft(1).pass_seconds() == pytest.approx(0.001)


def test_only_decode_and_verification_steps_are_timed():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), ScriptedProposer([]))
    steps = SpeculationSteps(speculator, kv_manager=None, max_model_len=64)
    params = SamplingParams()

    def row(tokens: list[int], spec: int = 0) -> ScheduledRequest:
        proposed = tokens[len(tokens) - spec:] if spec else []
        return ScheduledRequest("r", tokens, 10, [0], params, spec_token_ids=proposed)

    steps.observe_step([row([1]), row([2, 3, 4], spec=2)], 0.01)
    steps.observe_step([row([1]), row([5, 6, 7])], 0.02)  # a prefill chunk: not timed
    steps.observe_step([row([1])], 0.0)  # not timed by the engine
    steps.observe_step([], 0.01)
    assert speculator.costs.step(2).weight == 1.0 and speculator.costs.step(2).tokens == 4.0
    assert set(speculator.costs.steps) == {2}  # the class of 2-3 sequences only


def test_one_spike_moves_the_costs_a_bounded_step():
    """A 0.2 s outlier (a huge page faulted in, a garbage collection) counts as SPIKE times the
    prediction: the draft's pass cost and the step line move by what that allows, worked out here."""
    draft = DraftCost()
    for _ in range(10):
        draft.observe(2, 0.010)  # 5 ms a pass
    draft.observe(1, 0.2)
    weight = sum(0.97 ** i for i in range(10))  # the decayed passes and seconds before the spike
    expected = (0.97 * weight * 0.010 + SPIKE * 0.005) / (0.97 * weight * 2 + 1)
    assert draft.pass_seconds() == pytest.approx(expected)
    assert draft.pass_seconds() < 0.0056

    steps = StepCost()
    for tokens in (1, 9) * 10:
        steps.observe(tokens, 0.004 + 0.0008 * tokens)
    capped = StepCost()
    for tokens in (1, 9) * 10:
        capped.observe(tokens, 0.004 + 0.0008 * tokens)
    steps.observe(1, 0.2)
    capped.observe(1, SPIKE * 0.0048)
    assert steps.line() == pytest.approx(capped.line())
    assert steps.line()[0] < 0.0055


def test_each_class_of_batch_sizes_has_its_own_costs():
    """Steps and draft passes are fitted per class of batch sizes (1, 2-3, 4-7, 8-15, 16-31, ...): the
    default model's float32 steps cost 13.8 ms up to ~4 rows, then ~1.07 ms a row, and its Q8_0 draft
    pass 4.2 ms for one row, 13.2 for 16. Batch 1: r = 0.6 / 13.6, c = 4.2 / 13.6 = 0.31; batch 16:
    the line through 16 + 16 j rows is 7.1 ms + 1.07 ms a row, r = 0.15, c = 13.2 / 7.1 > 1: the
    threshold passes 1 and nothing is drafted; an n-gram proposal (no draft pass) at acceptance
    0.85 still gets k = 2, (16 r) / (1 + 16 r) = 0.71 < 0.85 ** 2."""
    config = SpeculativeConfig(method="self", num_speculative_tokens=8)
    speculator = Speculator(config, ScriptedProposer([]))
    for rows in (1, 9, 1, 5):
        speculator.observe_step(rows, 0.0136 + 0.0006 * rows, batch_size=1)
    speculator.observe_draft(3, 3 * 0.0042, batch_size=1)
    for j in (0, 1, 2, 0, 3):
        speculator.observe_step(16 + 16 * j, 0.0071 + 0.00107 * (16 + 16 * j), batch_size=16)
    speculator.observe_draft(2, 2 * 0.0132, batch_size=16)
    assert speculator.token_cost(1) == pytest.approx(0.6 / 13.6)
    assert speculator.draft_cost(1) == pytest.approx(4.2 / 13.6)
    assert speculator.token_cost(16) == pytest.approx(1.07 / 7.1) == speculator.token_cost(31)
    assert speculator.draft_cost(16) == pytest.approx(13.2 / 7.1)
    assert speculator._threshold(16) > 1.0
    for _ in range(6):
        speculator.record("a", 8, 7)
    rate = speculator._rate("a", False)
    assert rate == pytest.approx(0.874, abs=1e-3)
    assert speculator._k("a", speculator._threshold(16), False) == 0
    r16 = 16 * 1.07 / 7.1
    no_draft = r16 / (1 + r16)
    assert rate ** 2 > no_draft > rate ** 3
    assert speculator._k("a", speculator._threshold(16, drafting=False), False) == 2
    assert speculator._k("a", speculator._threshold(1), False) >= 7  # threshold 0.338 at batch 1


def test_undetermined_weight_time_takes_the_prior_rows_out():
    """Steps of one row count only (every sequence of 64 verifying 8 proposals: 576 rows, 0.6 s)
    determine no line; T_weights is then the mean step over 1 + 576 * 0.1, not 0.6 s, and a 42 ms
    draft pass costs 4.1 of it, not 0.07: nothing more is drafted."""
    speculator = Speculator(SpeculativeConfig(method="self", num_speculative_tokens=8), ScriptedProposer([]))
    for _ in range(3):
        speculator.observe_step(576, 0.6, batch_size=64)
    speculator.observe_draft(8, 8 * 0.042, batch_size=64)
    assert speculator.costs.step(64).line() is None and speculator.token_cost(64) == 0.1
    assert speculator.costs.step(64).weights_seconds(0.1) == pytest.approx(0.6 / 58.6)
    assert speculator.draft_cost(64) == pytest.approx(0.042 * 58.6 / 0.6)
    assert speculator._threshold(64) > 1.0


def test_a_class_not_yet_seen_takes_the_nearest_larger_one():
    """Batch 16 timed, then the batch shrinks to 5 (class 4-7, never timed): it takes batch 16's costs,
    not the priors; batch 40 (never timed, nothing larger) takes batch 16's too; with nothing timed
    at all the priors hold."""
    speculator = Speculator(SpeculativeConfig(method="self", num_speculative_tokens=8), ScriptedProposer([]))
    assert speculator.token_cost(5) == 0.1 and speculator.draft_cost(5) == 0.3
    speculator.observe_step(1, 0.0137, batch_size=1)
    speculator.observe_step(3, 0.0151, batch_size=1)
    for j in (0, 1, 2, 0):
        speculator.observe_step(16 + 16 * j, 0.0071 + 0.00107 * (16 + 16 * j), batch_size=16)
    speculator.observe_draft(1, 0.0132, batch_size=16)
    assert speculator.token_cost(5) == speculator.token_cost(16) == speculator.token_cost(40)
    assert speculator.token_cost(5) == pytest.approx(1.07 / 7.1)
    assert speculator.draft_cost(5) == pytest.approx(13.2 / 7.1) and speculator._threshold(5) > 1.0
    assert speculator.token_cost(1) == pytest.approx(0.7 / 13.0)
