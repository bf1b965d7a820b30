"""Oaken thresholds file: round trip and every validation error."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvmosaic.quant import thresholds as kvt

IDENTITY = kvt.ModelIdentity("tiny", "llama", 2, 1, 16, 32, 100, 0.125)
LAYERS = torch.tensor([[[-3.0, -0.1, 0.1, 2.5], [-1.0, -0.05, 0.04, 1.2]]] * 2)
CENTER = torch.linspace(-1, 1, 2 * 1 * 16).view(2, 1, 16)


def _write(tmp_path, data) -> str:
    path = tmp_path / "thr.json"
    path.write_text(json.dumps(data))
    return str(path)


def _valid() -> dict:
    return kvt.KVThresholds(IDENTITY, LAYERS, CENTER, sparse_capacity=5, num_prompts=3).to_json()


def test_save_load_round_trip(tmp_path):
    original = kvt.KVThresholds(IDENTITY, LAYERS, CENTER, 0.05, 0.05, 6, 100, "docs", 0.01, {"prompt_len": 64})
    original.save(tmp_path / "t.json")
    loaded = kvt.load(tmp_path / "t.json", IDENTITY)
    assert torch.equal(loaded.layers, LAYERS) and torch.equal(loaded.k_center, CENTER) and loaded.model == IDENTITY
    assert (loaded.sparse_capacity, loaded.outer_ratio, loaded.extra) == (6, 0.05, {"prompt_len": 64})


@pytest.mark.parametrize("change,message", [
    (dict(num_hidden_layers=3), "num_hidden_layers=2, but this model .* has num_hidden_layers=3"),
    (dict(head_dim=32), "head_dim"),
    (dict(architecture="qwen2"), "architecture"),
    (dict(fingerprint=0.2), "other weights"),
])
def test_wrong_model_is_a_clear_error(tmp_path, change, message):
    path = _write(tmp_path, _valid())
    with pytest.raises(ValueError, match=message):
        kvt.load(path, dataclasses.replace(IDENTITY, **change))


def test_bf16_rounding_of_the_same_weights_still_matches():
    IDENTITY.check_matches(dataclasses.replace(IDENTITY, fingerprint=0.125 * (1 + 1e-5)))


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("format"), "not a kvmosaic KV thresholds file"),
    (lambda d: d.update(version=9), "unsupported KV thresholds version"),
    (lambda d: d["layers"].pop(), r"shape \(1, 2, 4\), expected \(2, 2, 4\)"),
    (lambda d: d["layers"][0].pop("v"), "missing or bad field"),
    (lambda d: d["layers"][0].update(k=[1.0, -0.1, 0.1, 2.0]), "outer_lo <= inner_lo <= 0"),
    (lambda d: d.update(sparse_capacity=99), "sparse_capacity"),
    (lambda d: d["layers"][1]["k_center"][0].pop(), "k_center has shape|expected sequence"),
    (lambda d: d["layers"][0]["k_center"][0].__setitem__(2, float("nan")), "k_center must be finite"),
    (lambda d: d["layers"][0].pop("k_center"), "missing or bad field"),
    (lambda d: d.update(outer_ratio=0.7, inner_ratio=0.5), "ratio"),
])
def test_malformed_files_are_rejected(tmp_path, edit, message):
    data = _valid()
    edit(data)
    with pytest.raises(ValueError, match=message):
        kvt.load(_write(tmp_path, data))


def test_version_1_files_load_with_zero_key_centers(tmp_path):
    data = _valid()
    data["version"] = 1
    for row in data["layers"]:
        del row["k_center"]
    loaded = kvt.load(_write(tmp_path, data), IDENTITY)
    assert torch.equal(loaded.layers, LAYERS) and torch.equal(loaded.k_center, torch.zeros(2, 1, 16))


def test_missing_and_non_json_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        kvt.load(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        kvt.load(tmp_path / "bad.json")


def test_other_models_need_their_own_file():
    with pytest.raises(ValueError, match="calibrate-kv"):
        kvt.for_model(None, IDENTITY, is_default_model=False)


def test_shipped_file_matches_the_default_model(default_model):
    identity = kvt.ModelIdentity.of(default_model.config, default_model.weights)
    shipped = kvt.for_model(None, identity, is_default_model=True)
    assert shipped.num_prompts >= 100 and shipped.calibration_text == "stdlib:module-docstrings"
    assert shipped.layers.shape == (default_model.config.num_hidden_layers, 2, 4)
    cfg = default_model.config
    assert shipped.k_center.shape == (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    assert shipped.k_center.abs().amax() > 0.5  # real keys have channels with a large common offset
