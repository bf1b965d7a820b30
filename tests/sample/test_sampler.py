import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmosaic.sample.penalties import apply_penalties, pad_token_ids
from kvmosaic.sample.sampler import (
    SamplingRow,
    add_logit_bias_,
    compute_logprobs,
    random_sample,
    sample,
    target_probs,
)
from kvmosaic.sample.topk_topp import apply_top_k_top_p_min_p
from kvmosaic.sampling_params import SamplingParams

NEG_INF = float("-inf")
PROBS = [0.5, 0.3, 0.15, 0.05]


def _row(generator=None, prompt=(), output=(), banned=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), generator, list(prompt), list(output), tuple(banned))


def _filter(logits, top_k=0, top_p=1.0, min_p=0.0) -> list[int]:
    """Kept token ids of a single row."""
    out = apply_top_k_top_p_min_p(
        torch.tensor([logits]), torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float64), torch.tensor([min_p])
    )
    return [i for i, v in enumerate(out[0].tolist()) if v != NEG_INF]


def _log(probs):
    return [math.log(p) for p in probs]


# --- top-k / top-p / min-p -------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k_top_p_min_p(logits, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert out.tolist() == [[NEG_INF, 5.0, NEG_INF, 4.0, NEG_INF]]


def test_top_k_ties():
    assert _filter([3.0, 1.0, 3.0, 1.0], top_k=2) == [0, 2]
    # A tie at the k-th value keeps every tied token: the result must not depend on sort order.
    assert _filter([3.0, 2.0, 2.0, 1.0], top_k=2) == [0, 1, 2]


def test_top_k_off_values_and_per_row_k():
    assert _filter([1.0, 2.0, 3.0], top_k=0) == [0, 1, 2]
    assert _filter([1.0, 2.0, 3.0], top_k=3) == [0, 1, 2]
    assert _filter([1.0, 2.0, 3.0], top_k=7) == [0, 1, 2]
    logits = torch.tensor([[1.0, 2.0, 3.0]] * 3)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([1, 0, 2]), torch.ones(3), torch.zeros(3))
    assert (out != NEG_INF).sum(dim=1).tolist() == [1, 3, 2]


def test_top_p_on_a_hand_made_distribution():
    assert _filter(_log(PROBS), top_p=0.8) == [0, 1]
    assert _filter(_log(PROBS), top_p=0.81) == [0, 1, 2]
    assert _filter(_log(PROBS), top_p=0.5) == [0]
    assert _filter(_log(PROBS), top_p=0.01) == [0]
    assert _filter(_log(PROBS), top_p=1.0) == [0, 1, 2, 3]
    shuffled = [PROBS[2], PROBS[0], PROBS[3], PROBS[1]]
    assert _filter(_log(shuffled), top_p=0.8) == [1, 3]


def test_top_p_sees_the_top_k_distribution():
    # Without top-k, 0.5 + 0.3 < 0.84 needs a third token; after top_k=3, (0.5 + 0.3) / 0.95 >= 0.84.
    assert _filter(_log(PROBS), top_p=0.84) == [0, 1, 2]
    assert _filter(_log(PROBS), top_k=3, top_p=0.84) == [0, 1]


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_wide_nucleus_matches_a_full_sort(top_p):
    # A flat, shuffled distribution whose nucleus holds hundreds of tokens.
    order = torch.randperm(2000, generator=torch.Generator().manual_seed(0))
    logits = (-torch.arange(2000, dtype=torch.float32) * 1e-3)[order]
    probs = logits.double().softmax(dim=-1).sort(descending=True).values
    expected = int((probs.cumsum(0) - probs < top_p - 1e-6).sum())
    assert len(_filter(logits.tolist(), top_p=top_p)) == expected


def test_min_p():
    assert _filter(_log(PROBS), min_p=0.2) == [0, 1, 2]  # floor 0.1
    assert _filter(_log(PROBS), min_p=0.35) == [0, 1]  # floor 0.175
    assert _filter(_log(PROBS), min_p=1.0) == [0]
    assert _filter(_log(PROBS), min_p=0.0) == [0, 1, 2, 3]


def test_filters_do_not_modify_their_input():
    logits = torch.tensor([_log(PROBS)])
    before = logits.clone()
    apply_top_k_top_p_min_p(logits, torch.tensor([1]), torch.tensor([0.5]), torch.tensor([0.5]))
    assert torch.equal(logits, before)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.floats(-20, 20), min_size=1, max_size=40),
    top_k=st.integers(0, 50),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_filters_keep_the_top_token_and_everything_above_any_kept_token(values, top_k, top_p, min_p):
    values = torch.tensor(values).tolist()  # compare in the float32 the filters see
    kept = _filter(values, top_k=top_k, top_p=top_p, min_p=min_p)
    assert values.index(max(values)) in kept
    lowest_kept = min(values[i] for i in kept)
    assert kept == [i for i, v in enumerate(values) if v >= lowest_kept]
    if top_k:
        assert len(kept) >= min(top_k, len(values)) or top_p < 1 or min_p > 0


def test_top_p_after_top_k_with_ties_past_k():
    # The k-th value ties with tokens beyond k: all tied tokens stay and top-p sees them all.
    assert _filter([3.0, 2.0, 2.0, 2.0, 1.0], top_k=2) == [0, 1, 2, 3]
    assert _filter([3.0, 2.0, 2.0, 2.0, 1.0], top_k=2, top_p=0.99) == [0, 1, 2, 3]
    assert _filter([3.0, 2.0, 2.0, 2.0, 1.0], top_k=2, top_p=0.3) == [0]


@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(st.lists(st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0]), min_size=8, max_size=8), min_size=1,
                  max_size=4),
    top_k=st.lists(st.integers(0, 9), min_size=4, max_size=4),
    top_p=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4),
)
def test_top_k_then_top_p_equals_applying_them_one_after_the_other(rows, top_k, top_p):
    # Exercises the shortcut that finds the nucleus among the top-k logits against the full sort.
    logits, n = torch.tensor(rows), len(rows)
    k, p, off_p, zeros = torch.tensor(top_k[:n]), torch.tensor(top_p[:n]), torch.ones(n), torch.zeros(n)
    combined = apply_top_k_top_p_min_p(logits, k, p, zeros)
    stepwise = apply_top_k_top_p_min_p(apply_top_k_top_p_min_p(logits, k, off_p, zeros), 0 * k, p, zeros)
    assert torch.equal(combined, stepwise)


# --- penalties ---------------------------------------------------------------------------


def _penalize(logits, prompt, output, presence=0.0, frequency=0.0, repetition=1.0):
    rows = len(logits)
    return apply_penalties(
        torch.tensor(logits),
        pad_token_ids(prompt),
        pad_token_ids(output),
        torch.full((rows,), presence),
        torch.full((rows,), frequency),
        torch.full((rows,), repetition),
    ).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    out = _penalize([[2.0, -2.0, 1.0, -1.0, 0.5]], prompt=[[0]], output=[[1, 1, 0]], repetition=2.0)
    # Tokens seen several times are penalized once; unseen tokens are untouched.
    assert out == [[1.0, -4.0, 1.0, -1.0, 0.5]]


def test_presence_and_frequency_use_output_counts_only():
    out = _penalize([[2.0, -2.0, 1.0, -1.0]], prompt=[[0, 1]], output=[[2, 3, 2, 2]], presence=0.5, frequency=0.25)
    assert out == [[2.0, -2.0, 1.0 - 3 * 0.25 - 0.5, -1.0 - 0.25 - 0.5]]


def test_repetition_applies_before_presence_and_frequency():
    out = _penalize([[2.0, -2.0]], prompt=[[]], output=[[0, 1, 1]], presence=0.5, frequency=1.0, repetition=2.0)
    assert out == [[2.0 / 2 - 1.0 - 0.5, -2.0 * 2 - 2.0 - 0.5]]


def test_penalties_per_row_with_padding():
    logits = [[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]]
    out = apply_penalties(
        torch.tensor(logits),
        pad_token_ids([[0, 1, 2], []]),
        pad_token_ids([[2, 2], []]),
        torch.tensor([0.0, 1.0]),
        torch.tensor([1.0, 1.0]),
        torch.tensor([2.0, 2.0]),
    )
    assert out.tolist() == [[1.0, -4.0, 0.5 - 2.0], [2.0, -2.0, 1.0]]


def test_penalties_do_not_modify_their_input():
    logits = torch.tensor([[2.0, -2.0]])
    ones = torch.ones(1)
    apply_penalties(logits, pad_token_ids([[0]]), pad_token_ids([[1]]), ones, ones, torch.full((1,), 2.0))
    assert logits.tolist() == [[2.0, -2.0]]


# --- sample() ----------------------------------------------------------------------------


def test_greedy_is_argmax_and_first_index_on_ties():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 5.0]])
    out = sample(logits, [_row(temperature=0.0), _row(temperature=0.0)])
    assert [t.token_id for t in out] == [1, 0]


def test_greedy_rows_take_the_argmax_given():
    """``argmax`` picks the greedy rows' tokens, all-greedy batches and mixed ones alike; a penalized or
    banned row reaches it processed; random rows never do."""
    seen = []

    def argmax(x):
        seen.append(x.clone())
        return x.argmax(dim=-1)

    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 4.0], [0.0, 0.0, 9.0]])
    greedy = [_row(temperature=0.0), _row(temperature=0.0, output=[0], repetition_penalty=2.0), _row(temperature=0.0)]
    assert [t.token_id for t in sample(logits, greedy, argmax)] == [1, 2, 2]
    assert torch.equal(seen[-1][1], torch.tensor([2.5, 1.0, 4.0]))
    mixed = [_row(temperature=0.0), _row(temperature=1.0, generator=torch.Generator().manual_seed(0)),
             _row(temperature=0.0)]
    out = sample(logits, mixed, argmax)
    assert [out[0].token_id, out[2].token_id] == [1, 2] and torch.equal(seen[-1], logits[[0, 2]])


def test_greedy_sees_penalties():
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    out = sample(logits, [_row(temperature=0.0, output=[0], repetition_penalty=2.0)])
    assert out[0].token_id == 1


def test_banned_ids_are_never_sampled():
    logits = torch.tensor([[5.0, 4.0, 0.0, 4.5]] * 200)
    rows = [_row(temperature=0.0, banned=(0,))] + [_row(banned=(0, 3)) for _ in range(199)]
    rows[5].generator = torch.Generator().manual_seed(5)
    out = [t.token_id for t in sample(logits, rows)]
    assert out[0] == 3
    assert 0 not in out[1:] and 3 not in out[1:]


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    rows = [
        _row(logprobs=5, temperature=0.7, top_k=3, output=[1, 2], presence_penalty=1.0),
        _row(logprobs=0, temperature=0.0, repetition_penalty=1.5, prompt=[4]),
        _row(),
    ]
    out = sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(out[:2]):
        assert token.logprob == pytest.approx(reference[i, token.token_id].item(), abs=1e-6)
    assert out[2].logprob is None and out[2].top_logprobs is None  # not asked for: not computed
    values, ids = reference[0].topk(5)
    assert list(out[0].top_logprobs) == ids.tolist()
    assert list(out[0].top_logprobs.values()) == pytest.approx(values.tolist(), abs=1e-6)
    assert out[1].top_logprobs == {}
    assert out[2].top_logprobs is None
    assert torch.allclose(compute_logprobs(logits), reference)


def _draws(logits_row, seed, position, batch_size, steps=20):
    """Token ids a seeded row draws over several steps when placed among other rows."""
    generator = torch.Generator().manual_seed(seed)
    others = torch.Generator().manual_seed(seed + 1)
    noise = torch.randn(batch_size, logits_row.shape[0], generator=others)
    drawn = []
    for _ in range(steps):
        logits = noise.clone()
        logits[position] = logits_row
        rows = [_row(generator=torch.Generator().manual_seed(100 + i) if i % 2 else None, top_k=i % 3 * 5)
                for i in range(batch_size)]
        if batch_size > 1:
            rows[1] = _row(temperature=0.0, output=[3, 3], frequency_penalty=1.0)
        rows[position] = _row(generator=generator, temperature=0.9, top_p=0.95)
        drawn.append(sample(logits, rows)[position].token_id)
    return drawn


def test_seeded_row_draws_the_same_tokens_alone_or_in_a_batch():
    logits_row = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    alone = _draws(logits_row, seed=42, position=0, batch_size=1)
    assert _draws(logits_row, seed=42, position=3, batch_size=8) == alone
    assert _draws(logits_row, seed=42, position=6, batch_size=8) == alone
    assert len(set(alone)) > 1  # the generator advances between steps
    assert _draws(logits_row, seed=43, position=0, batch_size=1) != alone


def _chi_square(counts, probs, total):
    return sum((c - p * total) ** 2 / (p * total) for c, p in zip(counts, probs))


# 99.9th percentile of chi-square with 3 degrees of freedom.
CHI2_3DOF_999 = 16.27


def test_unseeded_sampling_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    drawn = random_sample(probs.expand(20_000, 4), [None] * 20_000)
    assert _chi_square(torch.bincount(drawn, minlength=4).tolist(), probs.tolist(), 20_000) < CHI2_3DOF_999


def test_seeded_sampling_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    generator = torch.Generator().manual_seed(0)
    drawn = random_sample(probs.expand(20_000, 4), [generator] * 20_000)
    assert _chi_square(torch.bincount(drawn, minlength=4).tolist(), probs.tolist(), 20_000) < CHI2_3DOF_999


def test_temperature_reshapes_the_distribution():
    torch.manual_seed(1)
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = torch.tensor([_log(probs)] * 20_000)
    drawn = [t.token_id for t in sample(logits, [_row(temperature=0.5)] * 20_000)]
    sharpened = [p * p / sum(q * q for q in probs) for p in probs]  # softmax(log p / 0.5) = p^2 / sum
    counts = torch.bincount(torch.tensor(drawn), minlength=4).tolist()
    assert _chi_square(counts, sharpened, 20_000) < CHI2_3DOF_999


def test_zero_probability_tokens_are_never_drawn():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 2000)
    seeded = [torch.Generator().manual_seed(i) if i % 2 else None for i in range(2000)]
    drawn = random_sample(probs, seeded)
    assert set(drawn.tolist()) == {1, 3}


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 4), [_row()])


def test_logit_bias_shared_by_rows_is_added_to_each_row_once():
    # the n samples of a request share one dict: it is read once, and every row still gets it
    logits = torch.randn(6, 10)
    shared, other = {1: 2.0, 9: -3.0, 12: 5.0}, {1: 0.5}
    biases = [shared, None, other, shared, {}, shared]
    expected = logits.clone()
    for row, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            if token < 10:  # ids beyond the vocabulary are ignored
                expected[row, token] += value
    add_logit_bias_(logits, biases)
    assert torch.equal(logits, expected)


def test_a_tokens_logprob_is_the_same_number_as_its_top_and_prompt_logprob():
    """The chosen token's logprob is read off the same log-softmax as the top logprobs and the prompt
    logprobs (compute_logprobs), so a token scored as a prompt token and sampled gets one number."""
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(3)) * 4
    out = sample(logits, [_row(temperature=0.0, logprobs=2) for _ in range(6)])
    reference = compute_logprobs(logits)
    for i, token in enumerate(out):
        assert token.logprob == reference[i, token.token_id].item()
        assert token.top_logprobs[token.token_id] == token.logprob


def test_seeded_rows_distribution_is_computed_from_its_row_alone():
    """Rows filtered together share widths (top-k's padding to the batch's largest k) and paths (top-p
    over the kept values or the whole vocab); a seeded row's probabilities, which its draws follow,
    are its own bit for bit, whatever else is in the batch."""
    gen = torch.Generator().manual_seed(4)
    mine = torch.randn(1, 4096, generator=gen) * 3
    params = dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02)
    alone = target_probs(mine, [_row(torch.Generator(), **params)])
    for others in ([dict(top_k=900, top_p=0.8)], [dict(top_p=0.5)], [dict(min_p=0.1, temperature=1.3)] * 19):
        logits = torch.cat([torch.randn(len(others), 4096, generator=gen) * 3, mine])
        rows = [_row(**o) for o in others] + [_row(torch.Generator(), **params)]
        assert torch.equal(target_probs(logits, rows)[-1:], alone)
