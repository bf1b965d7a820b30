"""The roofline planner against the published figures of "How to Scale Your Model", ch. 7 (inference).

Every expected number below is copied from the book's text and compared at the precision it is
printed with; the inputs are the ones the book states (13e9 params, 26 GB of weights, 6.7 GB of
KV cache per 8192-token sequence, 8 TPU v5e, ...).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvmosaic.config import ModelConfig
from kvmosaic.entrypoints.cli import main
from kvmosaic.ops.cpu import cpu_flags
from kvmosaic.planner import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    HardwareSpec,
    ModelSpec,
    Workload,
    critical_batch_size,
    kv_bytes_per_token,
    max_batch_size,
    param_count,
    plan,
    resolve_model,
    roofline_step_time,
    step_time,
    tokens_per_second,
    workload,
)
from kvmosaic.planner import probe as probe_module
from kvmosaic.planner.probe import THIS_MACHINE, packed_matmul, probe, probe_hardware
from kvmosaic.planner.roofline import format_rate

V5E = HARDWARE_PRESETS["tpu-v5e"]
LLAMA2 = MODEL_PRESETS["llama2-13b"]
BATCHES = [1, 8, 16, 32, 64, 240]
# The book's inputs for its LLaMA 2-13B tables: 13e9 bf16 params, 6.7 GB of KV per 8192-token sequence.
BOOK_LLAMA2 = Workload(num_params=13e9, weight_bytes=26e9, kv_bytes_per_token=6.7e9 / 8192)
BOOK_LLAMA2_SMALL_KV = Workload(num_params=13e9, weight_bytes=26e9, kv_bytes_per_token=6.7e9 / 5 / 8192)


def _columns(work: Workload) -> tuple[list, list, list[str], list[str], list[bool]]:
    rows = plan(work, V5E, 8192, BATCHES, "bf16", chips=8)
    return ([round(r.kv_cache_bytes / 1e9, 2) for r in rows], [round(r.total_bytes / 1e9, 2) for r in rows],
            [f"{1e3 * r.step.total_s:.2f}" for r in rows], [f"{r.tokens_per_s:.2f}" for r in rows],
            [r.fits for r in rows])


def test_llama2_13b_on_8_v5e_reproduces_the_published_table():
    kv, total, step_ms, tok_s, fits = _columns(BOOK_LLAMA2)
    assert kv == [6.7, 53.6, 107.2, 214.4, 428.8, 1608]
    assert total == [32.7, 79.6, 133.2, 240.4, 454.8, 1634]
    assert step_ms == ["4.98", "12.13", "20.30", "36.65", "69.33", "249.09"]
    assert tok_s == ["200.61", "659.30", "787.99", "873.21", "923.13", "963.53"]
    # "We OOM beyond batch size 16" on 8 chips' 128GiB.
    assert fits == [True, True, True, False, False, False]
    assert max_batch_size(BOOK_LLAMA2, V5E, 8192, chips=8) == 16


def test_llama2_13b_with_a_5x_smaller_kv_cache_reproduces_the_published_table():
    kv, total, step_ms, tok_s, fits = _columns(BOOK_LLAMA2_SMALL_KV)
    assert kv == [1.34, 10.72, 21.44, 42.88, 85.76, 321.6]
    assert total == [27.34, 36.72, 47.44, 68.88, 111.76, 347.6]
    assert step_ms == ["4.17", "5.60", "7.23", "10.50", "17.04", "52.99"]
    assert tok_s == ["239.94", "1429.19", "2212.48", "3047.62", "3756.62", "4529.34"]
    # "We can fit a much bigger batch of 64."
    assert fits == [True, True, True, True, True, False]


def test_the_book_inputs_are_the_llama2_13b_preset_rounded():
    params = param_count(LLAMA2)
    assert f"{params:.2g}" == "1.3e+10"  # "13e9 total parameters"
    assert round(params * 2 / 1e9) == 26  # "That uses 26GB"
    assert f"{8192 * kv_bytes_per_token(LLAMA2, 2) / 1e9:.1f}" == "6.7"
    gqa = ModelSpec("LLaMA-2-13B, 8 KV heads", 40, 5120, 13824, 40, 8, 128, 32000)  # "1:5 GMQA"
    assert f"{8192 * kv_bytes_per_token(gqa, 2) / 1e9:.2f}" == "1.34"
    # Unrounded, the preset lands within 0.3% of the book's step time.
    exact = roofline_step_time(LLAMA2, V5E, 1, 8192, weight_bytes_per_param=2, kv_bytes_per_elem=2, chips=8)
    assert exact.total_s == pytest.approx(4.98e-3, rel=3e-3)


def test_pop_quiz_30b_int8_on_a_4x4_v5e():
    # 30e9 int8 params, bf16 FLOPs, 100 kB/token of KV, 8192 context, 16 chips.
    quiz = Workload(num_params=30e9, weight_bytes=30e9, kv_bytes_per_token=100e3)
    small = step_time(quiz, V5E, 4, 8192, "bf16", chips=16)
    large = step_time(quiz, V5E, 256, 8192, "bf16", chips=16)
    assert f"{1e3 * small.total_s:.1f}" == "2.5" and not small.compute_bound
    assert round(1e3 * large.total_s) == 21 and large.compute_bound


def test_problem_model_parameters_and_int8_kv_per_token():
    problem = MODEL_PRESETS["problem"]
    assert f"{param_count(problem) / 1e9:.1f}" == "18.4"
    # The book's 131 kB is L*K*H = 64*8*256 bytes, i.e. the keys (or the values) alone; K and V together are twice that.
    per_token = kv_bytes_per_token(problem, 1)
    assert per_token == 2 * 64 * 8 * 256
    assert round(per_token / 2 / 1e3) == 131


@pytest.mark.parametrize(("tokens", "published_gb"), [(10_000, "8.19"), (100_000, "81.9"),
                                                      (500_000, "409.6"), (1_000_000, "819.2")])
def test_llama2_13b_kv_size_at_long_contexts(tokens, published_gb):
    decimals = len(published_gb.split(".")[1])
    assert f"{tokens * kv_bytes_per_token(LLAMA2, 2) / 1e9:.{decimals}f}" == published_gb


def test_critical_batch_size_depends_on_weight_and_compute_dtype():
    # 240 for bf16; 120 for int8 weights computed in bf16; back to 240 for int8 x int8.
    assert round(critical_batch_size(V5E, 2, "bf16")) == 240
    assert round(critical_batch_size(V5E, 1, "bf16")) == 120
    assert round(critical_batch_size(V5E, 1, "int8")) == 240
    b_crit = critical_batch_size(V5E, 2, "bf16")
    below = step_time(BOOK_LLAMA2, V5E, math.floor(b_crit), 8192, "bf16", chips=8)
    above = step_time(BOOK_LLAMA2, V5E, math.ceil(b_crit), 8192, "bf16", chips=8)
    assert not below.compute_bound and above.compute_bound
    assert above.mlp_s == above.matmul_flops_s and below.mlp_s == below.weight_load_s


def test_step_time_components_by_hand():
    # 1e9 params, 2e9 bytes, 1e3 KV bytes/token, 1e12 B/s, 1e14 FLOP/s: every term is easy to work out.
    hw = HardwareSpec("toy", hbm_bandwidth=1e12, hbm_bytes=1e10, flops_bf16=1e14)
    step = step_time(Workload(1e9, 2e9, 1e3), hw, batch=4, context_len=1000, compute_dtype="bf16", chips=2)
    assert step.kv_load_s == pytest.approx(4 * 1000 * 1e3 / 2e12)
    assert step.weight_load_s == pytest.approx(2e9 / 2e12)
    assert step.matmul_flops_s == pytest.approx(2 * 4 * 1e9 / 2e14)
    assert step.total_s == pytest.approx(2e-6 + 1e-3)
    assert tokens_per_second(4, step) == pytest.approx(4 / step.total_s)


def test_param_counts_match_the_checkpoints():
    assert param_count(MODEL_PRESETS["default"]) == 134_515_008  # SmolLM2-135M on the HF hub
    assert param_count(MODEL_PRESETS["llama3-8b"]) == 8_030_261_248  # Meta-Llama-3-8B on the HF hub


def test_kv_bytes_per_token_agrees_with_the_engine_config():
    smol = MODEL_PRESETS["default"]
    config = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, head_dim=64, tie_word_embeddings=True)
    assert kv_bytes_per_token(smol, 4) == config.kv_bytes_per_token(torch.float32)
    assert workload(smol, 2, 2).weight_bytes == 2 * param_count(smol)


def test_model_from_hf_config_file_and_directory(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for where in (tmp_path, tmp_path / "config.json"):
        model = resolve_model(str(where))
        assert param_count(model) == param_count(MODEL_PRESETS["llama3-8b"])
        assert kv_bytes_per_token(model, 2) == 131072
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "missing.json"))


def test_probe_returns_a_usable_hardware_spec():
    threads = torch.get_num_threads()
    hw = probe_hardware(0.05, buffer_bytes=1 << 20, matmul_size=64)
    assert torch.get_num_threads() == threads
    assert hw.name == THIS_MACHINE
    for value in (hw.hbm_bandwidth, hw.hbm_bytes, hw.flops_fp32, hw.flops_bf16):
        assert math.isfinite(value) and value > 0
    step = roofline_step_time(MODEL_PRESETS["default"], hw, 8, 256, weight_bytes_per_param=4, kv_bytes_per_elem=4)
    assert step.matmul_flops_s == pytest.approx(2 * 8 * param_count(MODEL_PRESETS["default"]) / hw.flops_fp32)


def test_probe_packed_matmul_computes_the_same_product():
    """The FLOP/s probe also times kvmosaic's packed kernel; what it times must be a @ b."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(48, 64, generator=gen), torch.randn(64, 96, generator=gen)
    fn = packed_matmul(a, b)
    if fn is None:
        pytest.skip("packed linear kernel not built")
    torch.testing.assert_close(fn(), a @ b, atol=1e-4, rtol=1e-5)
    assert packed_matmul(a[:, :60], b[:60, :90]) is None  # 90 columns: not a multiple of 16


def test_cli_plan_prints_the_book_table(capsys):
    args = ["plan", "--model", "llama2-13b", "--hardware", "tpu-v5e", "--chips", "8", "--context-len", "8192",
            "--num-params", "13e9", "--kv-bytes-per-token", str(6.7e9 / 8192)]
    assert main(args) == 0
    table = capsys.readouterr().out
    for figure in ("4.98", "12.13", "249.09", "200.61", "963.53", "1608.00"):
        assert figure in table
    assert main(args + ["--json", "--batch-sizes", "1,240"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["batch"] for row in report["rows"]] == [1, 240]
    assert f"{1e3 * report['rows'][1]['step_s']:.2f}" == "249.09"
    assert round(report["critical_batch_size"]) == 240 and report["max_batch_size"] == 16


def test_cli_plan_rejects_bad_input(capsys):
    assert main(["plan", "--model", "no-such-model"]) == 2
    assert main(["plan", "--weight-dtype", "fp32"]) == 2  # the book gives no fp32 FLOP/s for a v5e
    assert main(["plan", "--batch-sizes", "1,x"]) == 2
    assert "error:" in capsys.readouterr().err


def test_format_rate_never_rounds_a_slow_path_to_zero():
    assert format_rate(2.92e8) == "292 MFLOP/s"
    assert format_rate(2.137e10) == "21.4 GFLOP/s"
    assert format_rate(8 * 1.97e14) == "1576 TFLOP/s"


def test_probe_times_the_paths_kvmosaic_layers_take():
    """bf16 is timed on what a linear layer runs here (F.linear / the packed kernel), not torch.mm
    alone, which on AVX2 is a scalar fallback (about 0.3 GFLOP/s against 20 for F.linear)."""
    measured = probe(0.05, buffer_bytes=1 << 20, matmul_size=64)
    for rate in (measured.fp32, measured.bf16):
        assert rate.flops is not None and math.isfinite(rate.flops) and rate.flops > 0
        assert rate.path.startswith(("torch.mm", "F.linear", "packed kernel"))
    if "packed kernel" in measured.bf16.path and "avx512_bf16" not in cpu_flags():
        assert "widened to float32" in measured.bf16.path
    assert measured.spec.flops("bf16") == measured.bf16.flops
    assert measured.isa in measured.describe() and "n/a" not in measured.describe()


def test_a_path_far_slower_at_the_screen_size_is_not_timed_in_full(monkeypatch):
    # Seconds per call by (path, size): "slow" is 100x slower than "fast" at the screen size, so the
    # full-size product (the one that would take minutes on a scalar fallback) is never run.
    calls = []

    def paths(dtype, size):
        return {name: (lambda name=name, size=size: calls.append((name, size))) for name in ("fast", "slow")}

    seconds = {("fast", 256): 1e-3, ("slow", 256): 1e-1, ("fast", 512): 8e-3}
    monkeypatch.setattr(probe_module, "_matmul_paths", paths)
    monkeypatch.setattr(probe_module, "best_time", lambda fn, budget_s: (fn(), seconds[calls[-1]])[1])
    rate = probe_module.measure_matmul_flops(torch.bfloat16, 0.01, 512)
    assert rate.path == "fast" and rate.flops == pytest.approx(2 * 512**3 / 8e-3)
    assert ("slow", 512) not in calls and ("fast", 512) in calls


def test_a_matmul_path_that_cannot_run_gives_no_figure_instead_of_zero(monkeypatch, capsys):
    def fail(fn, budget_s):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(probe_module, "best_time", fail)
    rate = probe_module.measure_matmul_flops(torch.bfloat16, 0.01, 32)
    assert rate.flops is None and "not measured" in rate.path and "no such kernel" in rate.path
    no_bf16 = HardwareSpec("host", hbm_bandwidth=1e10, hbm_bytes=1e10, flops_bf16=None, flops_fp32=1e11)
    with pytest.raises(ValueError, match="no bf16 FLOP/s"):
        no_bf16.flops("bf16")
    with pytest.raises(ValueError):
        HardwareSpec("nothing", hbm_bandwidth=1e10, hbm_bytes=1e10, flops_bf16=None)
    # The planner says so instead of planning with a 0 rate.
    monkeypatch.setattr(probe_module, "probe", lambda seconds: probe_module.Probe(
        no_bf16, "AVX2+FMA", probe_module.MatmulRate(1e11, "torch.mm"), rate))
    assert main(["plan", "--probe", "--weight-dtype", "bf16"]) == 2
    assert "no bf16 FLOP/s" in capsys.readouterr().err
    assert main(["plan", "--probe", "--weight-dtype", "fp32", "--batch-sizes", "1"]) == 0
    out = capsys.readouterr().out
    assert "probed AVX2+FMA" in out and "bf16 n/a (not measured" in out and "100 GFLOP/s fp32" in out
