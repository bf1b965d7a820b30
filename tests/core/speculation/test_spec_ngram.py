from __future__ import annotations

import pytest

from kvmosaic.core.speculation.ngram import NgramProposer, lookup
from kvmosaic.core.speculation.proposer import ProposalRequest


def test_proposes_what_followed_the_suffix():
    #          0  1  2  3  4  5  6  7
    tokens = [1, 2, 3, 4, 5, 9, 2, 3]
    assert lookup(tokens, 2, 1, 3) == [4, 5]
    assert lookup(tokens, 5, 1, 3) == [4, 5, 9, 2, 3]


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # suffix [7, 8] occurred at 0 (followed by 1); [8] alone occurred more recently at 4 (followed by 2)
    tokens = [7, 8, 1, 0, 8, 2, 7, 8]
    assert lookup(tokens, 1, 1, 2) == [1]
    assert lookup(tokens, 1, 1, 1) == [2]


def test_most_recent_occurrence_of_the_same_length():
    tokens = [5, 1, 5, 2, 5]
    assert lookup(tokens, 1, 1, 1) == [2]


def test_min_n_and_no_match():
    tokens = [7, 8, 1, 0, 8]
    assert lookup(tokens, 2, 2, 3) == []
    assert lookup(tokens, 2, 1, 3) == [1, 0]
    assert lookup([1, 2, 3], 2, 1, 3) == []
    assert lookup([4], 2, 1, 3) == []


def test_proposal_is_cut_at_the_end_of_the_sequence():
    assert lookup([3, 4, 3], 5, 1, 2) == [4, 3]


def test_proposer_batches_and_validates():
    proposer = NgramProposer(1, 3)
    out = proposer.propose([ProposalRequest("a", [1, 2, 1], 2), ProposalRequest("b", [1, 2, 3], 2)])
    assert [p.token_ids for p in out] == [[2, 1], []]
    assert all(p.draft_probs is None for p in out)
    with pytest.raises(ValueError):
        NgramProposer(0, 3)
    with pytest.raises(ValueError):
        NgramProposer(4, 3)
