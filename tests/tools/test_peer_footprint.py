"""The peer benchmark's memory and roofline arithmetic (peer_runners/footprint.py, roofline.py) and which
file each engine reads for a model (model_source.py), on numbers that can be worked out by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peer_runners import common, footprint, roofline  # noqa: E402
from peer_runners.model_source import DefaultModel, ShapeModel, model_source  # noqa: E402
from peer_runners.shape_files import ShapeFiles  # noqa: E402

from kvmosaic.planner import ModelSpec  # noqa: E402

# 2 layers, 2 KV heads of 4: 2 * 2 * 2 * 4 = 32 K/V elements per token
TOY = ModelSpec("toy", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=2, head_dim=4,
                vocab_size=32, tie_embeddings=True)


def test_decode_share_is_the_roofline_time_over_the_measured_time():
    # 1 GB at 50 GB/s takes 20 ms; a 25 ms token reached 80% of the roofline
    assert roofline.decode_share(1e9, 0.025, 50e9) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        roofline.decode_share(1e9, 0.0, 50e9)


def test_every_engine_a_and_l_run_gets_its_share():
    a = {"engine": "llamacpp", "dtype": "q4_k_m", "workload": "A", "metric": "decode tok/s", "tokens_per_s": 50.0,
         "read_bandwidth": 40e9, "weights_read_bytes": 600_000_000, "seconds": 3.0}
    lvm = {**a, "engine": "kvmosaic", "workload": "L", "tokens_per_s": 40.0}
    c = {**a, "workload": "C"}  # a prefill rate has no decode roofline
    failed = {**a, "engine": "vllm", "error": "boom"}
    rows = roofline.decode_share_rows([a, lvm, c, failed], TOY)
    assert [(r["engine"], r["workload"]) for r in rows] == [("llamacpp", "A"), ("kvmosaic", "L")]
    # A: mean context 128 + 64 tokens of f16 KV (llama.cpp): 192 * 32 * 2 bytes
    kv_a = 192 * 32 * 2
    assert rows[0]["kv_bytes"] == kv_a
    assert rows[0]["share"] == pytest.approx((600e6 + kv_a) / (1 / 50 * 40e9))
    # L: 2048 + 64 tokens of float32 KV (kvmosaic under a GGUF weight format)
    assert rows[1]["kv_bytes"] == 2112 * 32 * 4
    assert "A q4_k_m    llamacpp" in "\n".join(roofline.decode_share_lines(rows))


def test_rss_is_set_against_weights_plus_kv_pool():
    assert footprint.rss_ratio(2_300, 1_000, 1_000) == pytest.approx(1.15)
    assert footprint.rss_ratio(1_500, 1_000, None) == 1.5
    assert footprint.rss_ratio(None, 1_000, 1_000) is None
    runs = [{"engine": "kvmosaic", "dtype": "q8_0", "workload": "A", "peak_rss_bytes": 3e9, "weights_bytes": 1e9,
             "kv_pool_bytes": 2e9},
            {"engine": "hf", "dtype": "bfloat16", "workload": "A", "peak_rss_bytes": 4e9, "weights_bytes": 2e9}]
    lines = footprint.rss_lines(runs)  # sorted by workload, dtype, engine
    assert "KV pool n/a -> 2.00x (over)" in lines[1]
    assert lines[2].endswith("RSS 3.00 GB; weights 1.00 GB + KV pool 2.00 GB -> 1.00x")


def test_kv_element_bytes_follow_each_engine_cache():
    assert footprint.kv_element_bytes("llamacpp", "q8_0") == 2  # f16 cache
    assert footprint.kv_element_bytes("kvmosaic", "q4_k_m") == 4  # float32 activations
    assert footprint.kv_element_bytes("vllm", "bfloat16") == 2


def test_hf_directory_bytes_count_the_run_dtype(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(10, 4), "model.norm.weight": torch.zeros(4)},
              str(tmp_path / "model.safetensors"))
    sizes = footprint.weights_bytes(tmp_path, "bfloat16")
    assert sizes == footprint.WeightBytes(held=88, read_per_token=88)  # tied: the table is the head
    save_file({"lm_head.weight": torch.zeros(10, 4)}, str(tmp_path / "head.safetensors"))
    untied = footprint.weights_bytes(tmp_path, "float32")
    assert untied == footprint.WeightBytes(held=336, read_per_token=336 - 160)
    assert footprint.weights_bytes(tmp_path / "missing", "float32") is None


def test_peak_rss_counts_this_process_and_its_live_workers():
    import subprocess
    import time

    alone = common.peak_rss_bytes()
    assert alone > 10 << 20
    code = "import sys; b = bytearray(300 << 20); sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"
    worker = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        assert common.peak_rss_bytes() > alone + (250 << 20)  # an engine's worker process counts
    finally:
        worker.communicate("")


def test_a_shape_gives_both_gguf_engines_the_same_file():
    source = model_source("llama-3.2-1b")
    assert isinstance(source, ShapeModel)
    files = ShapeFiles("llama-3.2-1b")
    for dtype, fmt in (("q4_k_m", "q4_k_m"), ("q8_0", "q8_0"), ("bfloat16", "bf16")):
        assert source.path("kvmosaic", dtype) == source.path("llamacpp", dtype) == files.gguf(fmt)
        assert source.startup_path(dtype) == files.gguf(fmt)
    assert source.path("vllm", "bfloat16") == source.path("hf", "bfloat16") == files.hf_dir
    assert source.supports("vllm", "bfloat16") and not source.supports("vllm", "q4_k_m")
    assert not source.supports("ct2", "bfloat16") and not source.supports("llamacpp", "q4_1")
    assert source.planner_model().num_kv_heads == 8


def test_a_shape_without_its_files_skips_the_engines_that_need_them(monkeypatch, tmp_path):
    monkeypatch.setattr("peer_runners.shape_files.MODELS", tmp_path)

    class Engine:
        def __init__(self, key):
            self.key = key

    skipped = model_source("qwen2.5-0.5b").prepare([Engine("kvmosaic"), Engine("hf")], ["q8_0"])
    assert list(skipped) == ["kvmosaic"]  # HF does not run q8_0, so it needs nothing
    assert "make_models.py --model qwen2.5-0.5b --formats q8_0" in skipped["kvmosaic"]


def test_the_default_model_keeps_its_files():
    source = model_source("smollm2-135m")
    assert isinstance(source, DefaultModel)
    assert source.startup_path("q4_1") is None  # the embedded file
    assert source.startup_dtypes(["float32", "q8_0", "q4_1"]) == ["float32", "q4_1"]
    assert source.path("kvmosaic", "q8_0").name == "hf-float32"  # quantized at load
    with pytest.raises(ValueError, match="unknown model"):
        model_source("llama-70b")
