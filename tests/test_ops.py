"""Compiled kernels vs their PyTorch reference (residual + RMSNorm)."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.model.layers import norm
from kvmosaic.ops import get_ops

pytestmark = pytest.mark.skipif(get_ops() is None, reason="C++ kernels not built (python -m kvmosaic.ops.build)")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_reference(dtype, with_delta, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    residual = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(37, 576, generator=gen).to(dtype) if with_delta else None
    weight = torch.rand(576, generator=gen).to(dtype)
    kernel_residual = residual.clone()
    out = norm.add_rms_norm(kernel_residual, delta, weight, 1e-5)
    monkeypatch.setattr(norm, "get_ops", lambda: None)
    ref_residual = residual.clone()
    ref = norm.add_rms_norm(ref_residual, delta, weight, 1e-5)
    torch.testing.assert_close(kernel_residual, ref_residual, atol=0, rtol=0)  # the add rounds identically
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_kernels_reject_bad_input():
    ops = get_ops()
    with pytest.raises(RuntimeError, match="residual"):
        ops.add_rms_norm(torch.randn(3, 5, 2), None, torch.ones(2), 1e-5)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        ops.add_rms_norm(torch.randn(3, 4, dtype=torch.float64), None, torch.ones(4, dtype=torch.float64), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_gemv_matches_dense_linear(rows, dtype):
    ops = get_ops()
    if not getattr(ops, "has_gemv", False) or (dtype == torch.bfloat16 and not ops.has_bf16_gemv):
        pytest.skip("CPU without AVX-512 / AVX512-BF16")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    w = torch.randn(1001, 576, generator=gen).to(dtype)  # 1001: a last block of fewer rows
    exact = x.double() @ w.double().T
    out = ops.gemv(x, w).double()
    if dtype == torch.float32:
        torch.testing.assert_close(out, exact, atol=1e-4, rtol=1e-5)
    else:
        # both sum bf16 products in float32; only the final rounding to bf16 and the order differ
        torch.testing.assert_close(out, exact, atol=0.25, rtol=1e-2)
        assert (out - exact).abs().max() <= (torch.nn.functional.linear(x, w).double() - exact).abs().max() * 1.5 + 1e-3
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        ops.gemv(torch.zeros(9, 576, dtype=dtype), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_uses_gemv_for_decode_rows_only(dtype):
    from kvmosaic.model.layers.linear import GEMV_MAX_ROWS, Linear

    w = torch.randn(64, 96).to(dtype)
    layer = Linear(w, torch.randn(64).to(dtype))
    if layer.gemv is None:
        pytest.skip("no GEMV kernel for this dtype on this CPU")
    calls = []
    kernel = layer.gemv
    layer.gemv = lambda x, weight: calls.append(x.shape[0]) or kernel(x, weight)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    split = layer.gemv_rows > GEMV_MAX_ROWS  # bfloat16: up to 16 rows in calls of 8
    for rows in (0, 1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 5, 2 * GEMV_MAX_ROWS + 1):  # 0 rows: a step that samples nothing
        x = torch.randn(rows, 96).to(dtype)
        ref = torch.nn.functional.linear(x.double(), w.double(), layer.bias.double())
        torch.testing.assert_close(layer(x).double(), ref, atol=tol * 5, rtol=tol)
    assert calls == ([1, GEMV_MAX_ROWS, GEMV_MAX_ROWS, 5] if split else [1, GEMV_MAX_ROWS])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 3072), (37, 3072), (5, 40)])  # width 40: a scalar tail
def test_silu_and_mul_matches_reference(dtype, rows, width):
    from kvmosaic.model.layers.activation import silu_and_mul_reference

    gate_up = (torch.randn(rows, width, generator=torch.Generator().manual_seed(5)) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow / underflow edges
    out = get_ops().silu_and_mul(gate_up)
    ref = silu_and_mul_reference(gate_up)
    assert out.shape == ref.shape and out.dtype == dtype
    if dtype == torch.bfloat16:  # the same roundings in the same order: bit-exact
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-6)
