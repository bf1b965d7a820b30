"""Oaken's perplexity cost over the float cache, with the thresholds shipped for the default model.

A short held-out run (the evaluation text, never the calibration text), prefilled in chunks so every
token attends to quantized K/V. The bound is on the ratio to the same run's float-cache perplexity,
so it holds whatever the float model's own perplexity on these tokens is. The cost on so few tokens moves
by tenths of a percent with the float arithmetic around the cache (each window's first token, which
every later query attends to, lands on other 4-bit levels): the bound is for the C++ kernels' path,
and the PyTorch reference path (+2.00% here) is not held to it.
"""

from __future__ import annotations

import pytest
import torch

from kvmosaic.eval.corpus import eval_text
from kvmosaic.eval.harness import EvalModel
from kvmosaic.eval.ppl import perplexity, tokenize_windows
from kvmosaic.ops import Kernels

WINDOW, TOKENS, CHUNK = 512, 1024, 128
# On these tokens (Zen 5 host, AVX-512 + BF16 kernels) Oaken costs +1.44%; with the sparse slots given to
# outer values in index order, as before, it cost +1.98%: the bound lies between (the AVX-512 and AVX2
# levels pass it too).
OAKEN_COST_BOUND = 0.017


@pytest.fixture(scope="module")
def oaken_cost(default_model) -> float:
    if Kernels.load().quant is None:
        pytest.skip("the bound is for the C++ kernels' path; none is built")
    em = EvalModel(default_model, torch.float32, None, max_len=WINDOW)
    windows = tokenize_windows(em, eval_text(), WINDOW, TOKENS)
    auto = perplexity(em, windows, "auto", CHUNK).perplexity
    return perplexity(em, windows, "oaken", CHUNK).perplexity / auto - 1


def test_oaken_cost_over_float_cache_stays_low(oaken_cost):
    assert 0 < oaken_cost < OAKEN_COST_BOUND, f"Oaken perplexity cost {100 * oaken_cost:+.2f}%"
