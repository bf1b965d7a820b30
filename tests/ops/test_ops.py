"""Compiled kernels vs their references (residual + RMSNorm, packed linear layers, SwiGLU, the
fused gate/up projection)."""

from __future__ import annotations

import pytest
import torch
from tile_modes import amx, tile_modes

from kvmosaic.model.layers import norm
from kvmosaic.ops import Kernels

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_reference(ops, dtype, with_delta):
    gen = torch.Generator().manual_seed(0)
    residual = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(37, 576, generator=gen).to(dtype) if with_delta else None
    weight = torch.rand(576, generator=gen).to(dtype)
    kernel_residual = residual.clone()
    out = norm.add_rms_norm(kernel_residual, delta, weight, 1e-5, ops)
    ref_residual = residual.clone()
    ref = norm.add_rms_norm(ref_residual, delta, weight, 1e-5, None)
    torch.testing.assert_close(kernel_residual, ref_residual, atol=0, rtol=0)  # the add rounds identically
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_kernels_reject_bad_input(ops):
    with pytest.raises(RuntimeError, match="residual"):
        ops.add_rms_norm(torch.randn(3, 5, 2), None, torch.ones(2), 1e-5)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        ops.add_rms_norm(torch.randn(3, 4, dtype=torch.float64), None, torch.ones(4, dtype=torch.float64), 1e-5)


@pytest.fixture
def ops(level_kernels: Kernels):
    """The float kernels of one ISA level (every built level in turn)."""
    return level_kernels.ops


def _packing_ops(ops, dtype):
    assert ops.packed_linear_supports(dtype, 16, 2), f"every level packs {dtype}"
    return ops


def test_amx_switch_turns_on_only_where_supported(ops):
    before = ops.amx_enabled()
    try:
        assert ops.set_amx(True) == ops.amx_supported()
        assert ops.set_amx(False) is False and not ops.amx_enabled()
    finally:
        ops.set_amx(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 17, 33, 64, 131, 300])
def test_packed_linear_matches_dense_linear(ops, rows, dtype):
    """Every row count (micro-kernel tails of 1-7 rows, several 128-row slabs; the AMX tiles' 16- and
    32-row blocks and a zero-padded tail) and a last panel of fewer than 48 columns (1008 = 21 panels
    of 48) against a float64 product, on each bf16 product path."""
    ops = _packing_ops(ops, dtype)
    for tiles in tile_modes(ops, dtype):
        with amx(ops, tiles):
            _check_packed_linear(ops, rows, dtype)


@pytest.mark.parametrize("rows", [17, 131])
def test_packed_linear_weights_past_one_cache_chunk(ops, rows):
    """K = 2048: a thread's share of the weight (about 1 MiB of bf16) spans more than one of the AMX
    product's L2 chunks of block pairs, and a 32-row group of activations is larger than L1."""
    ops = _packing_ops(ops, torch.bfloat16)
    for tiles in tile_modes(ops, torch.bfloat16):
        with amx(ops, tiles):
            _check_packed_linear(ops, rows, torch.bfloat16, k=2048)


def _check_packed_linear(ops, rows, dtype, k=576):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(1008 + 32, k, generator=gen) * (576 / k) ** 0.5).to(dtype)
    bias = torch.randn(w.shape[0], generator=gen).to(dtype)
    exact = x.double() @ w.double().T + bias.double()
    packed = ops.pack_linear_weight(w)
    assert packed.shape == (w.shape[0] // 16, k * 16) and packed.dtype == dtype
    out = ops.packed_linear(x, packed, bias.float()).double()
    if dtype == torch.float32:
        torch.testing.assert_close(out, exact, atol=1e-4, rtol=1e-5)
    else:
        # both sum bf16 products in float32; only the final rounding to bf16 and the order differ
        dense = torch.nn.functional.linear(x, w, bias).double()
        assert (out - exact).abs().max() <= (dense - exact).abs().max() * 1.5 + 1e-3
        torch.testing.assert_close(out, exact, atol=0.25, rtol=1e-2)
    no_bias = ops.packed_linear(x, packed).double()
    torch.testing.assert_close(no_bias, out - bias.double(), atol=0.25 if dtype == torch.bfloat16 else 1e-4,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_packed_linear_layout_and_bad_input(ops):
    ops = _packing_ops(ops, torch.float32)
    w = torch.arange(32 * 3, dtype=torch.float32).view(32, 3)  # w[n, k] = 3n + k
    packed = ops.pack_linear_weight(w).view(2, 3, 16)  # [block, k, column]
    assert torch.equal(packed[1, 2], w[16:32, 2])
    assert not ops.packed_linear_supports(torch.float32, 33, 3)  # output width not a multiple of 16
    assert not ops.packed_linear_supports(torch.float16, 32, 4)
    with pytest.raises(RuntimeError, match="N % 16"):
        ops.pack_linear_weight(torch.zeros(20, 8))
    with pytest.raises(RuntimeError, match="has 4 features"):
        ops.packed_linear(torch.zeros(2, 4), ops.pack_linear_weight(w))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.packed_linear(torch.zeros(2, 3, dtype=torch.float64), ops.pack_linear_weight(w))
    assert ops.packed_linear(torch.zeros(0, 3), ops.pack_linear_weight(w)).shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_packs_supported_weights_and_falls_back_otherwise(level_kernels, ops, dtype):
    from kvmosaic.model.layers.linear import make_linear

    _packing_ops(ops, dtype)
    # 40: not a multiple of 16, packed with zero columns and cut back; float16: no kernel, the dense path
    for out_features, wdtype, packed in ((64, dtype, True), (40, dtype, True), (40, torch.float16, False)):
        w = torch.randn(out_features, 96).to(wdtype)
        bias = torch.randn(out_features).to(wdtype)
        layer = make_linear(w, bias, level_kernels)
        assert layer.method.name == ("packed" if packed else "dense")
        tol = 1e-5 if wdtype == torch.float32 else 2e-2
        for shape in ((0, 96), (1, 96), (5, 96), (3, 7, 96)):  # 0 rows: a step that samples nothing
            x = torch.randn(*shape).to(wdtype)
            ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
            out = layer(x)
            assert out.shape == (*shape[:-1], out_features) and out.dtype == wdtype
            torch.testing.assert_close(out.double(), ref, atol=tol * 5, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 3072), (37, 3072), (5, 40)])  # width 40: a scalar tail
def test_silu_and_mul_matches_reference(ops, dtype, rows, width):
    from kvmosaic.model.layers.activation import silu_and_mul_reference

    gate_up = (torch.randn(rows, width, generator=torch.Generator().manual_seed(5)) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow / underflow edges
    out = ops.silu_and_mul(gate_up)
    ref = silu_and_mul_reference(gate_up)
    assert out.shape == ref.shape and out.dtype == dtype
    if dtype == torch.bfloat16:  # the same roundings in the same order: bit-exact
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16, 45, 130, 300])
def test_packed_swiglu_equals_projection_then_silu(ops, dtype, rows):
    """The fused gate/up product with SwiGLU in its epilogue gives bit for bit what the packed
    projection followed by silu_and_mul gives (same sums, same roundings), for every row tail of the
    6-row tile and several slabs; large gate values reach the exp overflow/underflow edges. On each
    bf16 product path (the AMX tiles sum in the same order in both products)."""
    ops = _packing_ops(ops, dtype)
    for tiles in tile_modes(ops, dtype):
        with amx(ops, tiles):
            _check_packed_swiglu(ops, dtype, rows)


@pytest.mark.parametrize("rows", [33, 130])
def test_packed_swiglu_weights_past_one_cache_chunk(ops, rows):
    """F = 768 over K = 2048: each thread's gate/up blocks span two of the AMX product's L2 chunks."""
    ops = _packing_ops(ops, torch.bfloat16)
    for tiles in tile_modes(ops, torch.bfloat16):
        with amx(ops, tiles):
            _check_packed_swiglu(ops, torch.bfloat16, rows, f=768, k=2048)


def _check_packed_swiglu(ops, dtype, rows, f=96, k=96):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    gate_up = (torch.randn(2 * f, k, generator=gen) * 2 * (96 / k) ** 0.5).to(dtype)  # F = 96: 3 panels of 32
    fused = ops.packed_swiglu(x, ops.pack_swiglu_weight(gate_up))
    unfused = ops.silu_and_mul(ops.packed_linear(x, ops.pack_linear_weight(gate_up)))
    assert fused.shape == (rows, f) and fused.dtype == dtype
    assert torch.equal(fused, unfused)
    g, u = (x.double() @ gate_up.double().T).chunk(2, dim=-1)
    torch.testing.assert_close(fused.double(), torch.nn.functional.silu(g) * u, atol=TOL[dtype] * 20,
                               rtol=TOL[dtype])


def test_packed_swiglu_layout_and_bad_input(ops):
    ops = _packing_ops(ops, torch.float32)
    gate_up = torch.arange(128 * 2, dtype=torch.float32).view(128, 2)  # 64 gate rows, then 64 up rows
    packed = ops.pack_swiglu_weight(gate_up).view(8, 2, 16)  # [block, k, column]
    # blocks: gate 0-15, gate 16-31, up 0-15, up 16-31, gate 32-47, ...
    for block, first_row in enumerate([0, 16, 64, 80, 32, 48, 96, 112]):
        assert torch.equal(packed[block, 1], gate_up[first_row:first_row + 16, 1])
    assert ops.packed_swiglu_supports(torch.float32, 64, 2)
    assert not ops.packed_swiglu_supports(torch.float32, 48, 2)  # F not a multiple of 32
    with pytest.raises(RuntimeError, match="F % 32"):
        ops.pack_swiglu_weight(torch.zeros(96, 8))
    with pytest.raises(RuntimeError, match="has 3 features"):
        ops.packed_swiglu(torch.zeros(2, 3), ops.pack_swiglu_weight(gate_up))
    assert ops.packed_swiglu(torch.zeros(0, 2), ops.pack_swiglu_weight(gate_up)).shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_projection_fuses_supported_widths_and_falls_back_otherwise(level_kernels, ops, dtype):
    from kvmosaic.model.layers.linear import make_gated

    _packing_ops(ops, dtype)
    for width, fused in ((64, True), (48, False)):  # 48: not a multiple of 32 -> projection, then SwiGLU
        gate, up = torch.randn(width, 96).to(dtype), torch.randn(width, 96).to(dtype)
        layer = make_gated(gate, up, level_kernels, dtype)
        assert layer.method.fuses_swiglu == fused
        for shape in ((0, 96), (1, 96), (7, 96), (2, 3, 96)):
            x = torch.randn(*shape).to(dtype)
            ref = torch.nn.functional.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
            out = layer(x)
            assert out.shape == (*shape[:-1], width) and out.dtype == dtype
            torch.testing.assert_close(out.double(), ref, atol=TOL[dtype] * 20, rtol=TOL[dtype] * 5)
    with pytest.raises(ValueError, match="differ in shape"):
        make_gated(torch.zeros(64, 8), torch.zeros(64, 9))


def _stack_layer(ops, hidden=32, heads=2, kv_heads=1, head_dim=16, inter=32, dtype=torch.float32):
    """One decoder layer's 15 tensors in ops.layer_stack's order, float weights packed."""
    gen = torch.Generator().manual_seed(0)
    w = lambda n, k: ops.pack_linear_weight(torch.randn(n, k, generator=gen).to(dtype))
    none = torch.empty(0)
    qkv = w((heads + 2 * kv_heads) * head_dim, hidden)
    gate_up = ops.pack_swiglu_weight(torch.randn(2 * inter, hidden, generator=gen).to(dtype))
    return [torch.ones(hidden, dtype=dtype), qkv, none, none, none, w(hidden, heads * head_dim), none, none,
            torch.ones(hidden, dtype=dtype), gate_up, none, none, w(hidden, inter), none, none]


def test_layer_stack_checks_weights_and_caches_once_with_clear_errors(ops):
    layer = _stack_layer(ops)
    weights = ops.StackWeights(layer + layer)
    assert weights.layers == 2
    from kvmosaic.quant import interleaved as qi
    from kvmosaic.quant import weights as qw

    q8, q4 = (qi.interleave(qw.quantize(torch.randn(n, 32), kind)) for n, kind in ((48, "q8_0"), (16, "q4_1")))
    parts = [q8.codes, q8.scale, torch.empty(0), q4.codes, q4.scale, q4.extra]  # a composite qkv, 64 wide
    assert ops.StackWeights(layer + layer, [], [parts, []]).layers == 2
    with pytest.raises(RuntimeError, match="one list per layer"):
        ops.StackWeights(layer + layer, [], [parts])
    with pytest.raises(RuntimeError, match="two or more parts"):
        ops.StackWeights(layer + layer, [], [parts[:3], []])
    with pytest.raises(RuntimeError, match="15 weights per layer"):
        ops.StackWeights(layer[:-1])
    with pytest.raises(RuntimeError, match="norm weight"):
        ops.StackWeights([torch.ones(7)] + layer[1:])
    with pytest.raises(RuntimeError, match="wrong shapes"):  # down projection fed the wrong width
        ops.StackWeights(layer[:12] + [ops.pack_linear_weight(torch.randn(32, 64)), layer[13], layer[14]])
    bf16_norms = [t.bfloat16() if i in (0, 8) else t for i, t in enumerate(layer)]
    with pytest.raises(RuntimeError, match="packed float weights"):
        ops.StackWeights(bf16_norms)
    cache = torch.zeros(2, 4, 4, 1, 16)
    caches = ops.StackCaches([cache, cache.clone()])
    assert caches.layers == 2
    with pytest.raises(RuntimeError, match="KV caches"):
        ops.StackCaches([cache, torch.zeros(2, 4, 4, 1, 32)])
    with pytest.raises(RuntimeError, match="KV caches"):
        ops.StackCaches([cache.to(torch.float64)])
    one = torch.zeros(1, dtype=torch.long)
    rope = torch.zeros(8, 8)
    args = (one, rope, rope, one, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
            torch.zeros(0, 3, dtype=torch.long), [], None, 2, 1, 1e-5, 0.25)
    out = ops.layer_stack(torch.randn(1, 32), weights, caches, *args)  # a decode row through both layers
    assert out[0].shape == (1, 32) and out[1].shape == (1, 32) and torch.isfinite(out[1]).all()
    with pytest.raises(RuntimeError, match="weights of 2 layers, KV caches of 1"):
        ops.layer_stack(torch.randn(1, 32), weights, ops.StackCaches([cache]), *args)
    with pytest.raises(RuntimeError, match="head counts"):
        ops.layer_stack(torch.randn(1, 32), weights, caches, *args[:-4], 3, 1, 1e-5, 0.25)
    with pytest.raises(RuntimeError, match="dtype and the hidden size"):
        ops.layer_stack(torch.randn(1, 32).bfloat16(), weights, caches, *args)
    with pytest.raises(RuntimeError, match="cover every row"):
        ops.layer_stack(torch.randn(2, 32), weights, caches, *args)
    with pytest.raises(RuntimeError, match="one per row"):
        ops.layer_stack(torch.randn(1, 32), weights, caches, torch.zeros(2, dtype=torch.long), *args[1:])


def test_layer_stack_with_a_head_returns_the_final_norm_and_lm_head_of_its_output(ops):
    """With the final norm and LM head in its weights, a step returns the kept rows' float32 logits:
    the model's own add_rms_norm and linear applied to the headless stack's (residual, delta)."""
    layer = _stack_layer(ops)
    none = torch.empty(0)
    head_weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    norm = torch.rand(32) + 0.5
    head = [norm, ops.pack_linear_weight(head_weight), none, none]
    plain, headed = ops.StackWeights(layer + layer), ops.StackWeights(layer + layer, head)
    assert not plain.has_head and headed.has_head
    cache = torch.zeros(2, 4, 4, 1, 16)
    x = torch.randn(1, 32)
    one = torch.zeros(1, dtype=torch.long)
    rope = torch.zeros(8, 8)
    args = (one, rope, rope, one, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
            torch.zeros(0, 3, dtype=torch.long), [], None, 2, 1, 1e-5, 0.25)
    residual, delta = ops.layer_stack(x.clone(), plain, ops.StackCaches([cache.clone(), cache.clone()]), *args)
    expected = ops.packed_linear(ops.add_rms_norm(residual, delta, norm, 1e-5), head[1], None)
    (logits,) = ops.layer_stack(x.clone(), headed, ops.StackCaches([cache.clone(), cache.clone()]), *args)
    assert logits.dtype == torch.float32 and logits.shape == (1, 48)
    assert torch.equal(logits, expected)
    kept_none = args[:-5] + (torch.zeros(0, dtype=torch.long),) + args[-4:]
    (empty,) = ops.layer_stack(x.clone(), headed, ops.StackCaches([cache.clone(), cache.clone()]), *kept_none)
    assert empty.shape == (0, 48) and empty.dtype == torch.float32
    with pytest.raises(RuntimeError, match="the head is the final norm"):
        ops.StackWeights(layer, head[:3])
    with pytest.raises(RuntimeError, match="the head is the final norm"):
        ops.StackWeights(layer, [torch.ones(7)] + head[1:])
    with pytest.raises(RuntimeError, match="LM head takes 64 features"):
        ops.StackWeights(layer, [norm, ops.pack_linear_weight(torch.randn(48, 64)), none, none])


@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 4096, 4097, 49152])
def test_argmax_rows_gives_torchs_ids(ops, width):
    """The greedy pick: torch.argmax(dim=-1) bit for bit, ties (first index), NaN (the first one, as
    torch counts NaN largest), +-inf, all -inf and -0.0 next to 0.0 included, at every row width's tail."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(12, width, generator=gen)
    last = width - 1
    x[1, :] = x[1, last // 2]  # every value tied
    x[2, last] = float("inf")
    x[3, :] = float("-inf")
    x[4, last // 3] = float("nan")
    x[4, last] = float("nan")
    x[5, last] = float("nan")  # NaN after the largest number
    x[6, :] = 0.0
    x[6, last // 2] = -0.0
    x[7, last // 2] = x[7, last] = 1e30  # a tie of two maxima far apart
    x[8, :] = torch.arange(width, 0, -1, dtype=torch.float32)  # the first lane of all
    x[9, :] = torch.arange(width, dtype=torch.float32)  # the last lane of all
    got = ops.argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, x.argmax(dim=-1))
    # one row alone: a wide one is split between the threads (a tie, a NaN or the maximum on either side)
    for row in x:
        assert ops.argmax_rows(row[None]).tolist() == [int(row.argmax())]
    x[10, :] = float("-inf")
    x[10, last] = 0.0  # the only finite value, at the end of the last part
    x[11, :] = 5.0
    x[11, last // 2 + 1:] = float("nan")  # NaNs in the second part only
    for row in x[10:]:
        assert ops.argmax_rows(row[None]).tolist() == [int(row.argmax())]
    strided = x.t().contiguous().t()  # not contiguous
    assert torch.equal(ops.argmax_rows(strided), x.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(x[:0]), x[:0].argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(x.double())
