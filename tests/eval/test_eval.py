"""Perplexity harness, built-in corpora and the calibrate-kv / eval-ppl commands."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from kvmosaic.config import CacheConfig
from kvmosaic.entrypoints.cli import main as cli_main
from kvmosaic.eval.cli import ppl_table
from kvmosaic.eval.corpus import calibration_text, eval_text
from kvmosaic.eval.harness import EvalModel, load_eval_model
from kvmosaic.eval.oracle import compare, llamacpp_missing
from kvmosaic.eval.paired import AgainstFirst, paired_cost
from kvmosaic.eval.ppl import PerplexityResult, perplexity, tokenize_windows
from kvmosaic.quant.format import KVFormat, row0_tail_bytes


def test_corpora_are_prose_and_disjoint():
    evaluation, calibration = eval_text(), calibration_text()
    assert len(evaluation) > 400_000 and len(calibration) > 100_000
    paragraphs = [p for p in calibration.split("\n\n") if len(p) > 120]
    assert len(paragraphs) > 200
    assert not any(p[:120] in evaluation for p in paragraphs)  # never evaluate on calibration text
    assert evaluation.count(" the ") > 2000 and calibration.count(" the ") > 1000


@pytest.fixture(scope="module")
def em(default_model) -> EvalModel:
    return EvalModel(default_model, torch.float32, None, max_len=1024)


@pytest.fixture(scope="module")
def windows(em) -> list[list[int]]:
    return tokenize_windows(em, eval_text(), 192, 384)


def test_chunking_does_not_change_unquantized_perplexity(em, windows):
    whole = perplexity(em, windows, "auto", chunk=192)
    chunked = perplexity(em, windows, "auto", chunk=48)
    assert whole.num_tokens == chunked.num_tokens == 2 * 191
    assert chunked.mean_nll == pytest.approx(whole.mean_nll, abs=1e-4)
    assert 2 < whole.perplexity < 100


def test_quantized_perplexity_ordering(em, windows):
    auto = perplexity(em, windows, "auto", chunk=64)
    int8 = perplexity(em, windows, "int8", chunk=64)
    int4 = perplexity(em, windows, "int4", chunk=64)
    assert abs(int8.perplexity / auto.perplexity - 1) < 0.005
    assert int4.perplexity > int8.perplexity
    assert (int8.bits_per_value, int4.bits_per_value) == (8.5, 4.5) and auto.bits_per_value == 32


def test_per_token_losses_and_divergence_from_the_float_cache(em, windows):
    """benchmarks/kv_quality.py's extra columns (kvmosaic/eval/paired.py): the paired cost is the
    perplexity ratio, a second run of the float cache is at (bfloat16-rounded) zero KL from the first,
    and bf16 records, int8 and int4 are ever farther."""
    against = AgainstFirst()
    auto = perplexity(em, windows, "auto", chunk=64, on_logprobs=against.keep)
    assert auto.token_nll.shape == (auto.num_tokens,)
    assert float(auto.token_nll.double().mean()) == pytest.approx(auto.mean_nll, rel=1e-12)
    divergences = {}
    for mode in ("auto", "bf16", "int8", "int4"):
        r = perplexity(em, windows, mode, chunk=64, on_logprobs=against.compare)
        divergences[mode] = against.take()
        cost, stderr = paired_cost(r.token_nll, auto.token_nll)
        assert cost == pytest.approx(100 * (r.perplexity / auto.perplexity - 1), abs=1e-6)
        assert stderr >= 0 and divergences[mode].num_tokens == auto.num_tokens
    assert divergences["auto"].mean_kl < 1e-4 and divergences["auto"].top1 == 1.0
    kl = [divergences[mode].mean_kl for mode in ("auto", "bf16", "int8", "int4")]
    assert kl == sorted(kl) and kl[1] > kl[0] and kl[1] < 1e-3
    assert divergences["int4"].top1 < 1.0


@pytest.mark.slow
def test_calibrate_then_eval_ppl_commands(tmp_path, default_model_path, capsys):
    out = tmp_path / "thr.json"
    cli = [sys.executable, "-m", "kvmosaic.entrypoints.cli"]
    proc = subprocess.run(cli + ["calibrate-kv", "--num-prompts", "4", "--prompt-len", "32", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["num_prompts"] == 4 and len(data["layers"]) == 30
    assert data["version"] == 3 and len(data["key_rotation"]["signs"]) == 64  # keys rotated by default
    assert all(len(row["k_scale"]) == 3 and min(min(s) for s in row["k_scale"]) > 0 for row in data["layers"])
    proc = subprocess.run(cli + ["eval-ppl", "--kv-cache-dtype", "auto", "--kv-cache-dtype", "oaken", "--kv-thresholds",
                                 str(out), "--max-tokens", "129", "--window", "129", "--chunk", "32", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {r["kv_cache_dtype"]: r for r in json.loads(proc.stdout)["results"]}
    assert rows["auto"]["tokens"] == rows["oaken"]["tokens"] == 128
    assert math.isfinite(rows["oaken"]["perplexity"])
    tail = row0_tail_bytes(3, 64, CacheConfig().block_size)  # the eval cache's blocks keep row 0 in tails
    assert rows["oaken"]["bits_per_value"] == KVFormat("oaken", 3, 64, data["sparse_capacity"], tail).bits_per_value
    bad = ["eval-ppl", "--kv-cache-dtype", "oaken", "--kv-thresholds", str(tmp_path / "x.json"), "--max-tokens", "64"]
    assert cli_main(bad) == 2 and "not found" in capsys.readouterr().err  # the same main, in this process


def test_ppl_table_puts_each_weight_format_next_to_float_weights():
    def result(weights: str, kv: str, nll: float) -> PerplexityResult:
        return PerplexityResult(weights, kv, 100, nll, 32.0, 0, 1.0)

    rows = ppl_table([result("none", "auto", math.log(10)), result("q8_0", "auto", math.log(10.1)),
                      result("q4_0", "int8", math.log(12))])
    assert rows[1].split()[:4] == ["none", "auto", "10.0000", "+0.00%"]
    assert rows[2].split()[:4] == ["q8_0", "auto", "10.1000", "+1.00%"]
    assert rows[3].split()[3] == "-"  # no float-weights row with int8 KV to compare with


LLAMACPP_MISSING = llamacpp_missing()


@pytest.mark.skipif(LLAMACPP_MISSING is not None, reason=f"llama.cpp perplexity oracle: {LLAMACPP_MISSING}")
@pytest.mark.parametrize("quantization", [None, "auto"])
def test_llamacpp_oracle_agrees_on_the_shipped_q4_1_file(default_model_path, quantization):
    """Same GGUF file, same token ids: kvmosaic's perplexity within 1% of llama.cpp's."""
    try:
        em = load_eval_model(default_model_path, "float32", 256, quantization)
    except ValueError as exc:
        pytest.skip(str(exc))  # a loader without weight formats: only None
    # llama.cpp quantizes activations for its Q4_1 dot products: about 0.06 nats of noise per token,
    # so the text must be long enough to average it out (128 tokens alone can differ by 1%).
    windows = tokenize_windows(em, eval_text(), 256, 1024)
    row = compare("shipped", default_model_path, em, windows)
    assert row.num_tokens == 4 * 255 and row.tensor_types == "Q4_1 x210, Q8_0 x1"
    assert 5 < row.llamacpp < 100
    assert row.agrees, f"kvmosaic {row.kvmosaic:.4f} vs llama.cpp {row.llamacpp:.4f}"
