"""KL divergence and top-1 agreement against a reference model (kvmosaic/eval/divergence.py, kl.py),
and the float-activations twin of a quantized model (harness.float_activations)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvmosaic.eval.corpus import eval_text
from kvmosaic.eval.divergence import Divergence, log_softmax, token_divergence
from kvmosaic.eval.harness import float_activations, load_eval_model
from kvmosaic.eval.kl import kvmosaic_divergence, reference_logprobs
from kvmosaic.eval.ppl import tokenize_windows
from kvmosaic.quant.weights import QuantizedWeight, dequantize


def logits_of(*probabilities: list[float]) -> np.ndarray:
    return np.log(np.array(probabilities, dtype=np.float64))


def test_log_softmax_normalizes_and_ignores_a_shift():
    logits = np.array([[1.0, 2.0, 3.0], [1000.0, 0.0, -1000.0]])
    out = log_softmax(logits)
    assert np.exp(out).sum(axis=1) == pytest.approx([1.0, 1.0])
    assert out[1, 0] == pytest.approx(0.0) and np.isfinite(out).all()  # no overflow at large logits
    assert log_softmax(logits[:1] + 7.5) == pytest.approx(out[:1])


def test_log_softmax_wants_positions_by_vocab():
    with pytest.raises(ValueError, match="positions, vocab"):
        log_softmax(np.zeros(4))


def test_kl_and_top1_by_hand():
    reference = log_softmax(logits_of([0.9, 0.1], [2 / 3, 1 / 3]))
    model = logits_of([0.2, 0.8], [2 / 3, 1 / 3]) + 3.0  # the model's logits, shifted: same distribution
    kl, same = token_divergence(reference, model)
    assert kl[0] == pytest.approx(0.9 * math.log(0.9 / 0.2) + 0.1 * math.log(0.1 / 0.8))  # 1.1457
    assert kl[1] == pytest.approx(0.0, abs=1e-15)
    assert same.tolist() == [False, True]


def test_kl_is_not_symmetric_and_never_negative():
    p, q = log_softmax(logits_of([0.9, 0.1])), log_softmax(logits_of([0.5, 0.5]))
    forward, _ = token_divergence(p, q)
    backward, _ = token_divergence(q, p)
    assert forward[0] == pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2))
    assert backward[0] == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5))
    assert forward[0] != pytest.approx(backward[0])
    rounding, _ = token_divergence(p, p + 1e-17)  # rounding cannot push it below zero
    assert rounding[0] >= 0.0


def test_shapes_must_match():
    with pytest.raises(ValueError, match="differ in shape"):
        token_divergence(np.zeros((2, 3)), np.zeros((2, 4)))


def test_summary_of_positions():
    kl = np.array([0.0] * 99 + [1.0])
    d = Divergence.of(kl, np.array([True] * 75 + [False] * 25))
    assert (d.num_tokens, d.mean_kl, d.top1) == (100, pytest.approx(0.01), 0.75)
    assert d.p99_kl == pytest.approx(0.01)  # numpy's linear interpolation between the 99th and 100th values
    with pytest.raises(ValueError, match="at least one"):
        Divergence.of(np.array([]), np.array([]))
    with pytest.raises(ValueError, match="as many"):
        Divergence.of(np.zeros(3), np.zeros(2, dtype=bool))


@pytest.fixture(scope="module")
def quantized(default_model_path):
    return load_eval_model(default_model_path, "float32", 64, "auto")


@pytest.fixture(scope="module")
def plain(quantized):
    return float_activations(quantized)


@pytest.mark.slow
def test_float_activations_dequantizes_the_same_weights(quantized, plain):
    name = next(n for n, w in quantized.loaded.weights.items() if isinstance(w, QuantizedWeight))
    assert not any(isinstance(w, QuantizedWeight) for w in plain.loaded.weights.values())
    assert torch.equal(plain.loaded.weights[name], dequantize(quantized.loaded.weights[name]))
    assert plain.weight_format == "none" and quantized.weight_format == "auto"


@pytest.mark.slow
def test_int8_activations_move_the_distribution_a_little(quantized, plain):
    windows = tokenize_windows(quantized, eval_text(), 64, 128)
    reference = reference_logprobs(plain, windows)
    assert [r.shape[0] for r in reference] == [63, 63]
    same = kvmosaic_divergence(plain, windows, reference)
    int8 = kvmosaic_divergence(quantized, windows, reference)
    assert same.mean_kl == pytest.approx(0.0, abs=1e-6) and same.top1 == 1.0 and same.num_tokens == 126
    assert 0 < int8.mean_kl < 0.05 and int8.top1 > 0.8
    with pytest.raises(ValueError, match="reference windows"):
        kvmosaic_divergence(quantized, windows, reference[:1])
