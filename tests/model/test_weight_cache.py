"""The weight cache: a GGUF's unpacked weights stored once, mapped at the next load."""

from __future__ import annotations

import os

import gguf
import pytest
import torch
from test_loader import write_tiny_gguf

from kvmosaic import LLM, SamplingParams
from kvmosaic.model import gguf_loader, weight_cache
from kvmosaic.model.loader import load_model
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


def _count_builds(monkeypatch) -> list[int]:
    builds = []
    original = gguf_loader._gguf_weights

    def counted(*args, **kwargs):
        builds.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(gguf_loader, "_gguf_weights", counted)
    return builds


def _parts(w) -> list[torch.Tensor]:
    if isinstance(w, qw.QuantizedWeight):
        return [t for t in (w.codes, w.scale, w.min, w.super_scale) if t is not None]
    return [w]


def _assert_bit_identical(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        assert type(a[name]) is type(b[name]), name
        if isinstance(a[name], qw.QuantizedWeight):
            assert a[name].source == b[name].source, name
        for x, y in zip(_parts(a[name]), _parts(b[name]), strict=True):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


def test_hit_gives_the_same_bits_without_unpacking(cache_dir, tiny_q8, monkeypatch):
    plain = load_model(str(tiny_q8), torch.float32, "auto").weights
    builds = _count_builds(monkeypatch)
    first = load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).weights
    second = load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).weights
    assert builds == [1]  # the second load came from the cache
    assert len(list(cache_dir.glob("tiny-q8.gguf.*.pt"))) == 1
    assert any(isinstance(w, qw.QuantizedWeight) for w in second.values())
    _assert_bit_identical(plain, first)
    _assert_bit_identical(plain, second)


def test_options_that_change_the_weights_have_their_own_entry(cache_dir, tiny_q8, monkeypatch):
    builds = _count_builds(monkeypatch)
    quantized = load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).weights
    floats = load_model(str(tiny_q8), torch.bfloat16, "none", weight_cache=True).weights
    assert builds == [1, 1] and len(list(cache_dir.glob("*.pt"))) == 2
    assert all(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 for w in floats.values())
    _assert_bit_identical(quantized, load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).weights)


def test_a_changed_file_is_unpacked_again(cache_dir, tiny_q8, monkeypatch):
    builds = _count_builds(monkeypatch)
    load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True)
    write_tiny_gguf(tiny_q8, matrix_type=Q.Q4_0)  # same name, new contents
    stat = tiny_q8.stat()
    os.utime(tiny_q8, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    again = load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).weights
    assert builds == [1, 1]
    assert {w.source for w in again.values() if isinstance(w, qw.QuantizedWeight)} == {"Q4_0"}
    _assert_bit_identical(load_model(str(tiny_q8), torch.float32, "auto").weights, again)


def test_a_corrupt_entry_is_rebuilt_with_a_warning(cache_dir, tiny_q8, monkeypatch):
    load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True)
    (entry,) = cache_dir.glob("*.pt")
    entry.write_bytes(b"not a torch file")
    expected = load_model(str(tiny_q8), torch.float32, "auto").weights
    builds = _count_builds(monkeypatch)
    with pytest.warns(UserWarning, match="ignoring the weight cache entry"):
        weights = load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).weights
    assert builds == [1]
    _assert_bit_identical(expected, weights)
    load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True)  # rewritten: a hit, no warning
    assert builds == [1]


def test_an_unwritable_cache_dir_falls_back_with_a_warning(tmp_path, tiny_q8, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(weight_cache.CACHE_DIR_ENV, str(blocker / "cache"))  # under a file: cannot be made
    with pytest.warns(UserWarning, match="cannot write the weight cache entry"):
        weights = load_model(str(tiny_q8), torch.float32, "auto", weight_cache=True).weights
    _assert_bit_identical(load_model(str(tiny_q8), torch.float32, "auto").weights, weights)


def test_a_cache_hit_gives_the_same_greedy_tokens(cache_dir, tiny_q8):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    options = dict(dtype="float32", kv_cache_memory="16MiB")
    plain = LLM(str(tiny_q8), weight_cache=False, **options).generate(["hello there"], params)
    assert not cache_dir.exists()  # turned off: nothing written
    cold = LLM(str(tiny_q8), **options).generate(["hello there"], params)
    warm = LLM(str(tiny_q8), **options).generate(["hello there"], params)
    tokens = [out.outputs[0].token_ids for out in (plain[0], cold[0], warm[0])]
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 12
