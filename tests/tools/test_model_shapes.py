"""The real-size model shapes of the peer benchmark (benchmarks/peer_runners/shapes.py), their files'
layout and the random HF directory writer: pure logic and tiny tensors, no model is built."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peer_runners import random_weights, shape_files  # noqa: E402
from peer_runners.shapes import SHAPES, ModelShape  # noqa: E402

from kvmosaic.model.hf_loader import hf_model_config  # noqa: E402
from kvmosaic.planner import param_count  # noqa: E402
from kvmosaic.planner.presets import model_from_hf_config  # noqa: E402

# Parameter counts the models' own pages publish (safetensors metadata of the released checkpoints).
PUBLISHED_PARAMS = {"qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400,
                    "smollm2-1.7b": 1_711_376_384, "llama-3.2-3b": 3_212_749_824}


@pytest.mark.parametrize("key", sorted(SHAPES))
def test_shape_has_the_published_parameter_count(key):
    assert SHAPES[key].num_params() == PUBLISHED_PARAMS[key]


@pytest.mark.parametrize("key", sorted(SHAPES))
def test_config_json_reads_back_as_the_same_shape(key):
    shape = SHAPES[key]
    config = shape.hf_config(bos_token_id=1, eos_token_id=2)
    parsed = hf_model_config(json.loads(json.dumps(config)))
    assert (parsed.hidden_size, parsed.num_hidden_layers, parsed.num_attention_heads, parsed.num_key_value_heads,
            parsed.head_dim, parsed.intermediate_size, parsed.vocab_size) == (
        shape.hidden_size, shape.num_hidden_layers, shape.num_attention_heads, shape.num_key_value_heads,
        shape.head_dim, shape.intermediate_size, shape.vocab_size)
    assert parsed.tie_word_embeddings == shape.tie_word_embeddings
    assert parsed.attention_bias == (shape.architecture == "qwen2")
    assert parsed.rope_theta == shape.rope_theta
    assert (parsed.rope_scaling or {}).get("rope_type") == ("llama3" if key.startswith("llama") else None)
    # the planner counts the same weights from the same file
    assert param_count(model_from_hf_config(config)) == shape.num_params()


def test_a_shape_with_heads_that_do_not_group_is_rejected():
    with pytest.raises(ValueError, match="not a multiple"):
        ModelShape("bad", "llama", hidden_size=64, num_hidden_layers=1, num_attention_heads=6,
                   num_key_value_heads=4, head_dim=16, intermediate_size=128, vocab_size=100, rope_theta=1e4,
                   tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=128)
    with pytest.raises(ValueError, match="architecture"):
        ModelShape("bad", "qwen3", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=4, head_dim=16, intermediate_size=128, vocab_size=100, rope_theta=1e4,
                   tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=128)


def test_formats_are_checked_and_ordered():
    small, large = SHAPES["qwen2.5-0.5b"], SHAPES["llama-3.2-3b"]
    assert shape_files.check_formats(small, ["q4_k_m", "f32", "bf16"]) == ["bf16", "f32", "q4_k_m"]
    with pytest.raises(ValueError, match="no f32 file"):
        shape_files.check_formats(large, ["f32"])
    with pytest.raises(ValueError, match="unknown formats"):
        shape_files.check_formats(small, ["q5_k"])
    with pytest.raises(ValueError, match="unknown model shape"):
        shape_files.check_shape("gpt-5")


def test_disk_plan_counts_the_hf_directory_and_the_bf16_source():
    shape = SHAPES["llama-3.2-1b"]
    plan = shape_files.disk_plan(shape, ["q4_k_m"])
    assert list(plan) == ["hf", "bf16", "q4_k_m"]
    assert plan["hf"] == plan["bf16"] == 2 * shape.num_params()
    files = shape_files.ShapeFiles("llama-3.2-1b")
    assert files.gguf_for_dtype("q4_k_m").name == "llama-3.2-1b-q4_k_m.gguf"
    assert files.gguf_for_dtype("bfloat16") == files.root / "llama-3.2-1b-bf16.gguf"


def test_shards_stay_under_the_limit_in_order():
    shapes = {"a": (10,), "b": (20,), "c": (100,), "d": (5,), "e": (5,)}
    plan = random_weights.shard_plan(shapes, shard_bytes=60, element_bytes=2)
    assert plan == [["a", "b"], ["c"], ["d", "e"]]  # c (200 bytes) alone: larger than a shard
    assert [n for shard in plan for n in shard] == list(shapes)


def test_random_tensors_depend_on_name_and_seed_only():
    torch.manual_seed(0)
    a = random_weights.random_tensor("model.layers.0.mlp.up_proj.weight", (8, 4))
    torch.manual_seed(1)  # the global generator is not used
    assert torch.equal(a, random_weights.random_tensor("model.layers.0.mlp.up_proj.weight", (8, 4)))
    assert not torch.equal(a, random_weights.random_tensor("model.layers.1.mlp.up_proj.weight", (8, 4)))
    assert not torch.equal(a, random_weights.random_tensor("model.layers.0.mlp.up_proj.weight", (8, 4), seed=1))
    assert a.dtype == torch.bfloat16
    norm = random_weights.random_tensor("model.norm.weight", (4,))
    bias = random_weights.random_tensor("model.layers.0.self_attn.q_proj.bias", (4,))
    assert torch.equal(norm, torch.ones(4, dtype=torch.bfloat16)) and not bias.any()


def test_chunked_generation_covers_every_row(monkeypatch):
    monkeypatch.setattr(random_weights, "CHUNK_ELEMENTS", 12)  # 3 rows of 4 per chunk
    big = random_weights.random_tensor("w.weight", (1000, 4)).float()
    rows = big.std(dim=1)
    assert 0.018 < big.std().item() < 0.022 and big.abs().max() < 0.2  # N(0, 0.02^2) everywhere
    assert rows.min() > 0 and len({tuple(r) for r in big.tolist()}) == 1000  # every chunk written, none repeated
