"""KV quantizers as pure functions: round-trip bounds, the exact Oaken bit layout, calibration maths."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.quant import int_quant, oaken
from kvmosaic.quant.calibration import choose_capacity, outliers_per_vector, overflow_rate, run_thresholds
from kvmosaic.quant.codec import decode_rows, encode_rows
from kvmosaic.quant.format import KVFormat, read_fp16, unpack_nibbles


def _data(kind: str, n: int = 64, hk: int = 3, d: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if kind == "normal":
        return torch.randn(n, hk, d, generator=gen)
    # heavy tails: Student-t with 2 degrees of freedom, plus a few fixed large channels (like K's)
    t = torch.randn(n, hk, d, generator=gen) / torch.randn(n, hk, d, generator=gen).pow(2).add(
        torch.randn(n, hk, d, generator=gen).pow(2)).div(2).sqrt()
    t[:, :, 5] *= 8
    return t.clamp(-200, 200)


@pytest.mark.parametrize("kind", ["normal", "heavy"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_int_round_trip_is_within_half_a_step(kind, mode):
    x = _data(kind)
    fmt = KVFormat(mode, 3, 64)
    records = int_quant.encode(x, fmt)
    assert records.shape == (64, fmt.record_bytes) and records.dtype == torch.uint8
    y = int_quant.decode(records, fmt)
    levels = 2**fmt.bits - 1
    span = x.amax(-1) - x.amin(-1)
    step = span / levels * (1 + 2**-9) * (1 + 2**-10)  # widened scale, fp16-rounded up to half an ulp
    lo_err = (x.amin(-1) - x.amin(-1).half().float()).abs()
    bound = step / 2 + lo_err + 1e-6
    assert ((x - y).abs() <= bound[..., None]).all()
    # every code is used within range and the extremes are reached
    codes = per_head_codes(records, fmt)
    assert int(codes.max()) == levels and int(codes.min()) == 0


def per_head_codes(records: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    codes = records.view(records.shape[0], fmt.num_kv_heads, -1)[..., 4:]
    return unpack_nibbles(codes) if fmt.bits == 4 else codes


def test_int8_is_much_closer_than_int4():
    x = _data("heavy")
    err = {m: (x - decode_rows(encode_rows(x, KVFormat(m, 3, 64))[0], KVFormat(m, 3, 64))).pow(2).mean()
           for m in ("int8", "int4")}
    assert err["int8"] * 200 < err["int4"]


def test_constant_vectors_are_exact():
    x = torch.full((2, 3, 64), 0.75)
    for mode in ("int8", "int4"):
        fmt = KVFormat(mode, 3, 64)
        assert torch.equal(decode_rows(encode_rows(x, fmt)[0], fmt), x)


THR = torch.tensor([-4.0, -0.5, 0.5, 4.0])


def _hand_made() -> torch.Tensor:
    """One 16-dim head vector: middle values 1.5 / -2.5, outliers at known indices."""
    x = torch.tensor([1.5, -2.5] * 8)
    x[3], x[10] = 6.0, -5.0  # outer: +2 above outer_hi, 1 below outer_lo
    x[7], x[12] = 0.25, -0.5  # inner (inner_lo itself is inner)
    return x.view(1, 1, 16)


def test_oaken_exact_bit_layout_on_a_hand_made_vector():
    fmt = KVFormat("oaken", 1, 16, sparse_capacity=3)
    assert (fmt.index_bits, fmt.entry_bytes, fmt.sparse_offset, fmt.record_bytes) == (4, 1, 16, 20)
    records, folded = oaken.encode(_hand_made(), THR, fmt)
    rec = records[0]
    assert int(folded) == 1  # 4 outliers, capacity 3: outer first, then inner in index order; x[12] folds
    half = lambda v: float(torch.tensor(v).half())  # noqa: E731
    mid_lo, mid_scale, out_scale, in_scale = read_fp16(rec[:8]).tolist()
    assert mid_lo == -2.0  # the shifted negative middle: -2.5 - (-0.5)
    assert mid_scale == half(3.0 / 15 * (1 + 2**-9))  # shifted middle spans [-2, 1]
    assert out_scale == half(2.0 / 15 * (1 + 2**-9))
    assert in_scale == half(0.25 / 15 * (1 + 2**-9))  # only x[7] = 0.25 is a kept inner value
    codes = unpack_nibbles(rec[8:16]).tolist()
    expected = [15, 0] * 8  # 1.5 -> 1.0 after the shift, the top level; -2.5 -> -2.0, the bottom one
    expected[3] = 15  # (6 - 4) / out_scale
    expected[10] = round(1.0 / out_scale)  # 7: magnitude of -5 below -4
    expected[7] = 15  # 0.25 / in_scale
    expected[12] = 9  # folded -0.5: shifted to 0, moved to the highest negative level (-2 + 9 * scale)
    assert codes == expected
    assert rec[8] == expected[0] | expected[1] << 4
    index_outer, sign = 1 << 4, 1 << 5
    assert rec[16:20].tolist() == [3, 3 | index_outer, 7, 10 | index_outer | sign]  # count, then entries by index

    y = oaken.decode(records, THR, fmt)[0, 0]
    assert float(y[3]) == 4.0 + 15 * out_scale
    assert float(y[10]) == -4.0 - 7 * out_scale
    assert float(y[7]) == 15 * in_scale
    assert float(y[0]) == pytest.approx(0.5 + (-2.0 + 15 * mid_scale))
    assert float(y[1]) == -2.5
    assert float(y[12]) == pytest.approx(-0.5 + (-2.0 + 9 * mid_scale))


def test_oaken_two_byte_entries_for_wide_heads():
    fmt = KVFormat("oaken", 2, 128, sparse_capacity=4)
    assert fmt.entry_bytes == 2 and fmt.index_bits == 7
    x = torch.full((1, 2, 128), 1.0)
    x[0, 1, 100] = -9.0
    records, folded = oaken.encode(x, THR, fmt)
    lists = records[0, fmt.sparse_offset:].view(-1)[: 2 * fmt.sparse_bytes].view(2, fmt.sparse_bytes)
    outer_neg = 100 | 1 << 7 | 1 << 8
    assert lists[1, 0] == 1 and lists[1, 1] == outer_neg & 255 and lists[1, 2] == outer_neg >> 8
    y = oaken.decode(records, THR, fmt)
    out_scale = float(read_fp16(records[0, 8:16])[2])  # head 1's outer scale
    assert float(y[0, 1, 100]) == -4.0 - 15 * out_scale == pytest.approx(-9.0, abs=0.02)


@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_oaken_round_trip_bounds_and_beats_int4(kind):
    x = _data(kind)
    thresholds = run_thresholds(x, 0.04, 0.06)
    fmt = KVFormat("oaken", 3, 64, sparse_capacity=64)  # room for every outlier: nothing folds
    records, folded = oaken.encode(x, thresholds, fmt)
    y = oaken.decode(records, thresholds, fmt)
    assert int(folded) == 0
    outer, inner = oaken.split_groups(x, thresholds)
    scales = read_fp16(records[:, : fmt.dense_offset].reshape(64, 3, 8))  # per head: mid lo, mid, outer, inner
    err = (x - y).abs()
    tol = 1e-5 * x.abs().amax()
    assert (err[outer] <= (scales[..., 2:3].expand_as(x)[outer] / 2 + tol)).all()
    assert (err[inner] <= (scales[..., 3:4].expand_as(x)[inner] / 2 + tol)).all()
    middle = ~(outer | inner)
    assert (err[middle] <= scales[..., 1:2].expand_as(x)[middle] + tol).all()  # one step at worst (side kept)
    int4 = KVFormat("int4", 3, 64)
    int4_err = (x - decode_rows(encode_rows(x, int4)[0], int4)).pow(2).mean()
    assert (x - y).pow(2).mean() < int4_err * (0.6 if kind == "normal" else 0.3)


def test_oaken_capacity_folds_and_counts_overflow():
    x = _data("heavy")
    thresholds = run_thresholds(x, 0.04, 0.06)
    outer, inner = oaken.split_groups(x, thresholds)
    per_vector = (outer | inner).sum(-1)
    for capacity in (0, 3, 7):
        fmt = KVFormat("oaken", 3, 64, sparse_capacity=capacity)
        records, folded = oaken.encode(x, thresholds, fmt)
        assert int(folded) == int((per_vector - capacity).clamp_min(0).sum())
        counts = records[:, fmt.sparse_offset:][:, : 3 * fmt.sparse_bytes].reshape(64, 3, -1)[..., 0]
        assert torch.equal(counts.long(), per_vector.clamp_max(capacity))
        assert torch.isfinite(oaken.decode(records, thresholds, fmt)).all()


def test_record_sizes_and_effective_bits_of_the_default_model():
    assert KVFormat("int8", 3, 64).record_bytes == 3 * 68
    assert KVFormat("int4", 3, 64).record_bytes == 3 * 36
    assert KVFormat("int4", 3, 64).bits_per_value == 4.5
    oak = KVFormat("oaken", 3, 64, sparse_capacity=7)
    assert oak.record_bytes == 3 * 8 + 3 * 32 + 3 * 8
    assert oak.bits_per_value == pytest.approx(6.0)
    with pytest.raises(ValueError, match="sparse_capacity"):
        KVFormat("oaken", 3, 64, sparse_capacity=65)
    with pytest.raises(ValueError, match="kv format"):
        KVFormat("fp8", 3, 64)


def test_run_thresholds_hit_the_ratios():
    x = torch.randn(20000, generator=torch.Generator().manual_seed(3))
    o_lo, i_lo, i_hi, o_hi = run_thresholds(x, 0.04, 0.06).tolist()
    assert (x > o_hi).sum() == 400 and (x < o_lo).sum() == 400
    assert ((x >= 0) & (x <= i_hi)).sum() == 600 and ((x < 0) & (x >= i_lo)).sum() == 600
    assert o_lo < i_lo < 0 < i_hi < o_hi


def test_capacity_choice_and_overflow_rate():
    counts = torch.tensor([0, 2, 4, 6, 8, 10, 12, 30])
    assert choose_capacity(counts, 1.0, 64) == 30
    assert choose_capacity(counts, 0.5, 64) == 7  # torch.quantile interpolates between 6 and 8
    assert overflow_rate(counts, 10) == pytest.approx((2 + 20) / 72)
    rows = torch.tensor([[[5.0, 0.0, 0.1, 1.0]]])
    assert outliers_per_vector(rows, torch.tensor([-2.0, -0.2, 0.2, 2.0])).tolist() == [3]
