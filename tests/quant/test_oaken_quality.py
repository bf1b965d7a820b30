"""Oaken's cost over the float cache, with the thresholds shipped for the default model.

A short held-out run (the evaluation text, never the calibration text), prefilled in chunks so every
token attends to quantized K/V, measured two ways against the same run on the float cache:

* the mean KL divergence of each next-token distribution from the float cache's: positive at every
  token, so it is steady (the kernels' path and the PyTorch reference's agree to a few percent) and
  the bound holds on both;
* the perplexity ratio, which averages per-token changes of both signs and moves by tenths of a point
  with the float arithmetic around the cache (the reference path costs +2.00% on these tokens where
  the kernels' path costs +1.44%): that bound is for the kernels' path only.
"""

from __future__ import annotations

import pytest
import torch

from kvmosaic.eval.corpus import eval_text
from kvmosaic.eval.harness import EvalModel
from kvmosaic.eval.paired import AgainstFirst
from kvmosaic.eval.ppl import perplexity, tokenize_windows
from kvmosaic.ops import Kernels

WINDOW, TOKENS, CHUNK = 512, 1024, 128
# On these tokens (Zen 5 host, AVX-512 + BF16 kernels) Oaken with row-0 tails and the key rotation costs
# +0.64% and 0.0056 nats/token (the reference path +1.63%, 0.0066: the perplexity of 1,024 tokens is that
# unsteady); with tails but unrotated keys it cost +0.70% and 0.0079 (reference +0.11%, 0.0086), with plain
# records +1.44% and 0.0135. The KL bound lies between the rotated and the unrotated keys on both paths;
# the perplexity bound is the loose one of before.
OAKEN_COST_BOUND = 0.017
OAKEN_KL_BOUND = 0.0075


@pytest.fixture(scope="module")
def runs(default_model) -> dict:
    em = EvalModel(default_model, torch.float32, None, max_len=WINDOW)
    windows = tokenize_windows(em, eval_text(), WINDOW, TOKENS)
    against = AgainstFirst()
    auto = perplexity(em, windows, "auto", CHUNK, on_logprobs=against.keep)
    oaken = perplexity(em, windows, "oaken", CHUNK, on_logprobs=against.compare)
    return {"cost": oaken.perplexity / auto.perplexity - 1, "divergence": against.take()}


def test_oaken_divergence_from_float_cache_stays_low(runs):
    divergence = runs["divergence"]
    assert 0 < divergence.mean_kl < OAKEN_KL_BOUND, f"Oaken KL {divergence.mean_kl:.5f} nats/token"
    assert divergence.top1 > 0.93


def test_oaken_cost_over_float_cache_stays_low(runs):
    if Kernels.load().quant is None:
        pytest.skip("the perplexity bound is for the C++ kernels' path; none is built")
    assert 0 < runs["cost"] < OAKEN_COST_BOUND, f"Oaken perplexity cost {100 * runs['cost']:+.2f}%"
