"""Oaken's sparse lists when a head vector has more outliers than slots: the outer values farthest past
their threshold are kept (the ones folded into the middle widen its range least), and the kernels
keep the same ones as the PyTorch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.quant import oaken
from kvmosaic.quant.format import KVFormat, read_fp16

THR = torch.tensor([-4.0, -0.5, 0.5, 4.0])


def test_farthest_outer_values_take_the_slots():
    fmt = KVFormat("oaken", 1, 16, sparse_capacity=3)
    x = torch.full((1, 1, 16), 1.5)
    x[0, 0, [1, 4, 6, 9, 13]] = torch.tensor([4.5, -9.0, 6.0, -4.25, 9.0])  # past by 0.5, 5, 2, 0.25, 5
    x[0, 0, 2] = 0.25  # inner: no slot left for it
    records, folded = oaken.encode(x, THR, fmt)
    assert int(folded) == 3  # x[1] and x[9], nearest their threshold, and the inner x[2]
    entries = records[0, fmt.sparse_offset:fmt.sparse_offset + fmt.sparse_bytes].tolist()
    outer, sign = 1 << 4, 1 << 5
    assert entries == [3, 4 | outer | sign, 6 | outer, 13 | outer]  # count, then the kept ones by index
    y = oaken.decode(records, THR, fmt)[0, 0]
    assert y[[4, 6, 13]].tolist() == pytest.approx([-9.0, 6.0, 9.0], abs=0.2)
    mid_scale = float(read_fp16(records[0, 2:4]))
    assert mid_scale == pytest.approx((4.0 + 3.75) / 15, rel=0.01)  # the middle spans the folded x[9], x[1]


def test_ties_keep_the_lower_index():
    fmt = KVFormat("oaken", 1, 16, sparse_capacity=2)
    x = torch.full((1, 1, 16), 1.0)
    x[0, 0, [3, 7, 11]] = torch.tensor([6.0, -6.0, 6.0])  # all 2 past their threshold
    records, folded = oaken.encode(x, THR, fmt)
    assert int(folded) == 1
    assert records[0, fmt.sparse_offset + 1:fmt.sparse_offset + 3].tolist() == [3 | 1 << 4, 7 | 1 << 4 | 1 << 5]


def _heavy_rows(n: int, hk: int, d: int, seed: int) -> torch.Tensor:
    """Rows whose vectors often hold more outliers than a capacity of 7: heavy tails and ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hk, d, generator=gen) * torch.rand(n, hk, 1, generator=gen) * 3
    x[:, :, 5] = x[:, :, 9] = 7.0  # equal distances past the threshold
    x[::3, :, :20] *= 4
    return x


@pytest.mark.parametrize("d", [64, 128, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_keeps_the_reference_outliers(level_kernels, d, dtype):
    hk, n, block = 3, 40, 4
    thr = (torch.tensor([-2.0, -0.1, 0.08, 2.1]), torch.tensor([-1.5, -0.05, 0.05, 1.4]))
    fmt = KVFormat("oaken", hk, d, 7)
    k, v = (_heavy_rows(n, hk, d, seed).to(dtype) for seed in (0, 1))
    pools = torch.zeros(2, n // block, block, fmt.record_bytes, dtype=torch.uint8)
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(2))
    folded = level_kernels.quant.quant_write(k, v, pools[0], pools[1], slots, 2, hk, d, 7, *thr, torch.zeros(0))
    ref_k, folded_k = oaken.encode(k.float(), thr[0], fmt)
    ref_v, folded_v = oaken.encode(v.float(), thr[1], fmt)
    assert int(folded_k) > n  # the lists overflow
    assert torch.equal(pools[0].view(-1, fmt.record_bytes)[slots], ref_k)
    assert torch.equal(pools[1].view(-1, fmt.record_bytes)[slots], ref_v)
    assert folded == int(folded_k + folded_v)
