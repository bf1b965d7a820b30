"""Speculative verification: exact greedy cases by hand, and the target distribution preserved."""

from __future__ import annotations

import torch

from kvmosaic.sample.rejection import verify_dense, verify_greedy, verify_one_hot
from kvmosaic.sample.sampler import SamplingRow, random_sample
from kvmosaic.sample.verify import Verification
from kvmosaic.sample.verify import verify as verify_rows
from kvmosaic.sampling_params import SamplingParams

NUM_SAMPLES = 100_000
# chi-square with 5 degrees of freedom: P(X > 20.52) = 0.001
CHI2_CRITICAL_DF5 = 20.52
TARGET = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                       [0.05, 0.10, 0.05, 0.30, 0.20, 0.30],
                       [0.10, 0.10, 0.20, 0.20, 0.20, 0.20]])
DRAFT = torch.tensor([[0.10, 0.40, 0.30, 0.05, 0.10, 0.05],
                      [0.30, 0.05, 0.25, 0.10, 0.10, 0.20]])


def _emitted(token_ids: torch.Tensor, num_emitted: torch.Tensor) -> list[list[int]]:
    return [row[:n] for row, n in zip(token_ids.tolist(), num_emitted.tolist())]


def test_greedy_by_hand():
    target = torch.tensor([[5, 7, 9, 2], [5, 7, 9, 2], [5, 7, 9, 2], [3, 3, 3, 3]])
    draft = torch.tensor([[5, 7, 1], [5, 7, 9], [1, 7, 9], [3, 4, 3]])
    assert _emitted(*verify_greedy(target, draft)) == [[5, 7, 9], [5, 7, 9, 2], [5], [3, 3]]


def test_verify_takes_greedy_targets_from_the_argmax_it_is_given(level_kernels):
    """Proposals 1 and 2 match the target's picks, the bonus row ties (4, 4): the first index wins, with
    the kernel's argmax at every built level as with torch's; one call for the sequence's rows."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 5.0], [4.0, 4.0, 0.0]])
    rows = [SamplingRow(SamplingParams(temperature=0.0), None, [7], []) for _ in range(3)]
    calls = []

    def argmax(x):
        calls.append(tuple(x.shape))
        return level_kernels.argmax(x)

    (emitted,) = verify_rows(logits, [Verification(rows, [1, 2])], argmax)
    assert calls == [(3, 3)] and [t.token_id for t in emitted] == [1, 2, 0]
    assert [t.token_id for t in verify_rows(logits, [Verification(rows, [1, 0])])[0]] == [1, 2]


def test_greedy_without_proposals_emits_the_target_token():
    assert _emitted(*verify_greedy(torch.tensor([[4], [8]]), torch.zeros((2, 0), dtype=torch.long))) == [[4], [8]]


def test_one_hot_target_is_greedy():
    target = torch.tensor([[5, 7, 9, 2], [5, 7, 9, 2]])
    probs = torch.nn.functional.one_hot(target, 10).float()
    draft = torch.tensor([[5, 7, 1], [5, 7, 9]])
    for generator in (None, torch.Generator().manual_seed(0)):
        assert _emitted(*verify_one_hot(probs, draft, generator)) == [[5, 7, 9], [5, 7, 9, 2]]


def test_dense_by_hand():
    # p == q everywhere: every proposal accepted, then the bonus token (p of the last row is one-hot)
    same = torch.tensor([[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    assert _emitted(*verify_dense(same, torch.tensor([[1, 0]]), same[:, :2])) == [[1, 0, 2]]
    # p(x) = 0 rejects x; the residual max(0, p - q) leaves only token 2
    p = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    assert _emitted(*verify_dense(p, torch.tensor([[0]]), q)) == [[2]]


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.shape[0]).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def _check_target_distribution(token_ids: torch.Tensor, num_emitted: torch.Tensor) -> None:
    # The toy target does not depend on the context: each emitted position follows its own row.
    assert _chi_square(token_ids[:, 0], TARGET[0]) < CHI2_CRITICAL_DF5
    second = token_ids[num_emitted >= 2, 1]
    assert second.numel() > NUM_SAMPLES // 10
    assert _chi_square(second, TARGET[1]) < CHI2_CRITICAL_DF5


def _draft_ids(generator: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.multinomial(DRAFT[i], NUM_SAMPLES, replacement=True, generator=generator)
                        for i in range(2)], dim=1)


def test_dense_proposals_keep_the_target_distribution():
    generator = torch.Generator().manual_seed(1234)
    draft_ids = _draft_ids(generator)
    target = TARGET.expand(NUM_SAMPLES, -1, -1)
    draft = DRAFT.expand(NUM_SAMPLES, -1, -1)
    token_ids, num_emitted = verify_dense(target, draft_ids, draft, generator)
    _check_target_distribution(token_ids, num_emitted)
    accepted = (num_emitted - 1).float().mean().item()
    assert 0.3 < accepted < 1.5  # some proposals accepted, some rejected


def test_one_hot_proposals_keep_the_target_distribution():
    generator = torch.Generator().manual_seed(99)
    # a deterministic proposer: each row proposes fixed ids, whatever they are
    draft_ids = torch.randint(0, TARGET.shape[1], (NUM_SAMPLES, 2), generator=generator)
    target = TARGET.expand(NUM_SAMPLES, -1, -1)
    for source in (generator, None):
        torch.manual_seed(7)
        token_ids, num_emitted = verify_one_hot(target, draft_ids, source)
        _check_target_distribution(token_ids, num_emitted)


def test_seeded_one_hot_draws_once_per_emitted_token_like_plain_decoding():
    probs = TARGET[None]
    plain_gen = torch.Generator().manual_seed(5)
    plain = [int(random_sample(TARGET[i][None], [plain_gen])[0]) for i in range(3)]
    spec_gen = torch.Generator().manual_seed(5)
    wrong = (plain[1] + 1) % TARGET.shape[1]
    token_ids, num_emitted = verify_one_hot(probs, torch.tensor([[plain[0], wrong]]), spec_gen)
    assert _emitted(token_ids, num_emitted) == [plain[:2]]
    # the generator advanced by exactly the two emitted draws: the next draw is plain decoding's third
    assert int(random_sample(TARGET[2][None], [spec_gen])[0]) == plain[2]


def test_seeded_verification_reproduces():
    draft_ids = torch.tensor([[1, 3]] * 50)
    target = TARGET.expand(50, -1, -1)
    draft = DRAFT.expand(50, -1, -1)
    for verify in (lambda g: verify_one_hot(target, draft_ids, g), lambda g: verify_dense(target, draft_ids, draft, g)):
        runs = [_emitted(*verify(torch.Generator().manual_seed(11))) for _ in range(2)]
        assert runs[0] == runs[1]
