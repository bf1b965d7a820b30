"""The repack-once cache: the products a model streams, stored by one start and read by the next."""

from __future__ import annotations

import os

import gguf
import pytest
import torch
from test_loader import write_tiny_gguf

from kvmosaic import LLM, SamplingParams
from kvmosaic.model import weight_cache
from kvmosaic.model.layers.linear_methods import CompositeKernel, QuantizedKernel
from kvmosaic.model.llama import LlamaForCausalLM
from kvmosaic.model.loader import load_model
from kvmosaic.ops import Kernels
from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw

Q = gguf.GGMLQuantizationType


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv(weight_cache.CACHE_DIR_ENV, str(directory))
    return directory


@pytest.fixture
def tiny_q8(tmp_path):
    path = tmp_path / "tiny-q8.gguf"
    write_tiny_gguf(path, matrix_type=Q.Q8_0)
    return path


@pytest.fixture
def tiny_mixed(tmp_path):
    """Q4_0 q and k beside Q8_0 v: fused as a composite qkv, as a Q4_K_M file's Q4_K q, k and Q6_K v are."""
    path = tmp_path / "tiny-mixed.gguf"
    write_tiny_gguf(path, matrix_type=Q.Q4_0, v_type=Q.Q8_0)
    return path


@pytest.fixture(scope="module")
def kernels() -> Kernels:
    loaded = Kernels.load()
    if not loaded.has("quantized_linear"):
        pytest.skip("the quantized kernels are not built")
    return loaded


def _build(path, kernels, dtype=torch.float32):
    """A model built through the cache as a worker builds it, and the store it asked."""
    loaded = load_model(str(path), dtype, "auto", weight_cache=True)
    store = weight_cache.PackedCache.open(loaded.cache_source, kernels)
    model = LlamaForCausalLM(loaded.config, loaded.weights, kernels, packed=store)
    store.finish()
    return model, store


def _streamed(model) -> dict[str, list[torch.Tensor]]:
    """Every quantized product's tensors as the kernels read them."""
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "method", None)
        if isinstance(method, QuantizedKernel | CompositeKernel):
            w = method.weight
            parts = w.parts if isinstance(method, CompositeKernel) else (w,)
            out[name] = [w.source, *(t for p in parts for t in (p.codes, p.scale, p.min, p.super_scale)
                                     if t is not None)]
    return out


def _assert_same_products(a: dict, b: dict) -> None:
    assert a and set(a) == set(b)
    for name in a:
        assert a[name][0] == b[name][0], name
        for x, y in zip(a[name][1:], b[name][1:], strict=True):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


def _forbid_repacking(monkeypatch) -> None:
    weight_cache.layout_fingerprint()  # computed once per process, before anything is forbidden

    def forbidden(*args, **kwargs):
        raise AssertionError("a warm start repacked a weight")

    for module, name in ((qi, "interleave"), (qw, "concat_rows"), (qw, "requantize")):
        monkeypatch.setattr(module, name, forbidden)


def test_a_warm_start_reads_every_product_without_repacking(cache_dir, tiny_q8, kernels, monkeypatch):
    plain = LlamaForCausalLM(*_loaded_parts(tiny_q8), kernels)
    cold, cold_store = _build(tiny_q8, kernels)
    assert not cold_store.hit and "lm_head" in cold_store.built
    assert len(list(cache_dir.glob("tiny-q8.gguf.*.packed"))) == 1
    _forbid_repacking(monkeypatch)
    warm, warm_store = _build(tiny_q8, kernels)
    # built again: only what runs off the quantized kernels (float down_proj, a 259-row head), never held
    assert warm_store.hit and warm_store.held and warm_store.held.isdisjoint(warm_store.built)
    assert set(warm_store.built) | warm_store.held == set(cold_store.built)
    _assert_same_products(_streamed(plain), _streamed(cold))
    _assert_same_products(_streamed(cold), _streamed(warm))


def _loaded_parts(path):
    loaded = load_model(str(path), torch.float32, "auto")
    return loaded.config, loaded.weights


def test_a_composite_product_is_stored_by_part_and_read_back(cache_dir, tiny_mixed, kernels, monkeypatch):
    plain = LlamaForCausalLM(*_loaded_parts(tiny_mixed), kernels)
    assert isinstance(plain.layers[0].qkv_proj.method, CompositeKernel)
    cold, cold_store = _build(tiny_mixed, kernels)
    _forbid_repacking(monkeypatch)
    warm, warm_store = _build(tiny_mixed, kernels)
    assert warm_store.hit and "model.layers.0.self_attn.qkv_proj" in warm_store.held
    assert [p.source for p in warm.layers[0].qkv_proj.method.weight.parts] == ["Q4_0", "Q8_0"]
    _assert_same_products(_streamed(plain), _streamed(cold))
    _assert_same_products(_streamed(cold), _streamed(warm))
    x = torch.randn(3, 32)
    assert torch.equal(warm.layers[0].qkv_proj(x), plain.layers[0].qkv_proj(x))


@pytest.mark.parametrize("model", ["tiny_q8", "tiny_mixed"])
def test_a_warm_start_gives_the_same_logprobs(cache_dir, model, request):
    path = request.getfixturevalue(model)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    options = dict(dtype="float32", kv_cache_memory="16MiB")
    plain = LLM(str(path), weight_cache=False, **options).generate(["hello there"], params)[0]
    assert not cache_dir.exists()  # turned off: nothing written
    cold = LLM(str(path), **options).generate(["hello there"], params)[0]
    warm = LLM(str(path), **options).generate(["hello there"], params)[0]
    assert len(list(cache_dir.glob("*.packed"))) == 1
    for out in (cold, warm):
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        assert out.outputs[0].logprobs == plain.outputs[0].logprobs
        assert out.prompt_logprobs == plain.prompt_logprobs


def test_options_and_layout_have_their_own_entries(cache_dir, tiny_q8, kernels, monkeypatch):
    assert not _build(tiny_q8, kernels)[1].hit
    assert not _build(tiny_q8, kernels, torch.bfloat16)[1].hit  # another dtype: another entry
    assert _build(tiny_q8, kernels)[1].hit and _build(tiny_q8, kernels, torch.bfloat16)[1].hit
    monkeypatch.setattr(weight_cache, "LAYOUT_VERSION", weight_cache.LAYOUT_VERSION + 1)
    assert not _build(tiny_q8, kernels)[1].hit
    monkeypatch.setattr(weight_cache, "layout_fingerprint", lambda: "another interleaved layout")
    assert not _build(tiny_q8, kernels)[1].hit
    assert len(list(cache_dir.glob("*.packed"))) == 4


def test_a_changed_file_is_repacked(cache_dir, tiny_q8, kernels):
    _build(tiny_q8, kernels)
    write_tiny_gguf(tiny_q8, matrix_type=Q.Q4_0)  # same name, new contents
    stat = tiny_q8.stat()
    os.utime(tiny_q8, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    model, store = _build(tiny_q8, kernels)
    assert not store.hit
    assert {products[0] for products in _streamed(model).values()} == {"Q4_0"}
    _assert_same_products(_streamed(LlamaForCausalLM(*_loaded_parts(tiny_q8), kernels)), _streamed(model))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_entry_is_rebuilt_with_a_warning(cache_dir, tiny_q8, kernels, damage):
    expected = _streamed(_build(tiny_q8, kernels)[0])
    (entry,) = cache_dir.glob("*.packed")
    data = entry.read_bytes()
    entry.write_bytes(b"not an entry" if damage == "garbage" else data[: len(data) // 2] + data[-16:])
    with pytest.warns(UserWarning, match="ignoring the weight cache entry"):
        model, store = _build(tiny_q8, kernels)
    assert not store.hit
    _assert_same_products(expected, _streamed(model))
    assert _build(tiny_q8, kernels)[1].hit  # rewritten: a hit, no warning


def test_an_unwritable_cache_dir_falls_back_with_a_warning(tmp_path, tiny_q8, kernels, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(weight_cache.CACHE_DIR_ENV, str(blocker / "cache"))  # under a file: cannot be made
    with pytest.warns(UserWarning, match="cannot write the weight cache entry"):
        model, store = _build(tiny_q8, kernels)
    assert not store.hit
    _assert_same_products(_streamed(LlamaForCausalLM(*_loaded_parts(tiny_q8), kernels)), _streamed(model))


def test_formats_other_than_auto_are_not_cached(tiny_q8):
    assert load_model(str(tiny_q8), torch.float32, "none", weight_cache=True).cache_source is None
    assert load_model(str(tiny_q8), torch.float32, "auto").cache_source is None


def test_the_tokenizer_description_is_cached(cache_dir, tiny_q8):
    plain = load_model(str(tiny_q8), torch.float32, "auto").tokenizer
    cold = load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).tokenizer
    (entry,) = cache_dir.glob("*.tokenizer.json")
    warm = load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).tokenizer
    text = "hello there, 123 <|im_end|>"
    assert plain.encode(text) == cold.encode(text) == warm.encode(text)
    entry.write_text(entry.read_text()[:-5])  # cut short: its key is gone
    with pytest.warns(UserWarning, match="ignoring the weight cache entry"):
        again = load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).tokenizer
    assert again.encode(text) == plain.encode(text)
    assert load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).tokenizer.encode(text) == plain.encode(
        text)
