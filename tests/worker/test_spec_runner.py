"""The model runner's sampling of a step mixing forks and verifications (logits made by hand)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvmosaic.outputs import ScheduledRequest
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.worker.model_runner import ModelRunner


def _peaked(token: int, vocab: int = 16) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[token] = 50.0
    return row


def test_forks_and_verifications_take_their_own_logits_rows():
    attention = SimpleNamespace(kv_cache=SimpleNamespace(block_size=4))
    runner = ModelRunner(torch.nn.Identity(), attention, eos_token_ids=(0,))
    # three forks of one prompt (one logits row), then a sequence verifying one proposal (two rows):
    # three plain sampling rows and three logits rows, yet not one row each
    forks = ScheduledRequest("a", [1, 2], 0, [0], SamplingParams(n=3, temperature=1.0), sample_ids=["a", "a#1", "a#2"],
                             sample_seeds=[1, 2, 3])
    verify = ScheduledRequest("b", [5, 7], 4, [1, 2], SamplingParams(temperature=0.0), sample_ids=["b"],
                              sample_seeds=[None], output_token_ids=[5], spec_token_ids=[7])
    logits = torch.stack([_peaked(3), _peaked(7), _peaked(9)])
    out = runner._sample(logits, [forks, verify])
    assert {seq: t.token_id for seq, t in out.sampled.items()} == {"a": 3, "a#1": 3, "a#2": 3, "b": 9}
    assert [t.token_id for t in out.accepted["b"]] == [7]
