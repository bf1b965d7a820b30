"""Row-0 tails of Oaken blocks (kvmosaic/quant/format.py, kvmosaic/quant/row0.py): each block's first
row is kept as an int8 record spread over the tails of the block's records. The kernels write and read
them bit for bit as the PyTorch reference does, at every ISA level built here; the row reads back as
the int8 codec's values; only a write of the block's first slot touches the tails; and they move with
the block."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.attention.kv_cache import KVCache, kv_format
from kvmosaic.attention.quantized import QuantizedKVLayer, dequantize_blocks, write_quantized
from kvmosaic.config import CacheConfig, ModelConfig
from kvmosaic.quant import int_quant, oaken
from kvmosaic.quant.format import KVFormat, row0_tail_bytes

BS, BLOCKS = 16, 6
THR = torch.tensor([-2.0, -0.03, 0.03, 2.0])


def _rows(hk: int, d: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k, v = 1.5 * torch.randn(n, hk, d, generator=gen), torch.randn(n, hk, d, generator=gen)
    k[:, :, 5] *= 6  # a large channel: outliers
    first = torch.tensor([0, BS, 2 * BS + 1])  # two block starts, one slot after a start
    rest = torch.randperm(BLOCKS * BS, generator=gen)
    slots = torch.cat([first, rest[~torch.isin(rest, first)]])[:n]
    return k, v, slots, 0.1 * torch.randn(hk, d, generator=gen)


def _layer(fmt: KVFormat, center: torch.Tensor) -> QuantizedKVLayer:
    pools = torch.zeros(2, BLOCKS, BS, fmt.record_bytes, dtype=torch.uint8)
    return QuantizedKVLayer(pools[0], pools[1], fmt, THR.clone(), THR.clone(), center)


def test_format_sizes():
    fmt = KVFormat("oaken", 3, 64, 13, row0_tail_bytes(3, 64, BS))
    assert (fmt.body_bytes, fmt.row0_tail, fmt.record_bytes) == (162, 13, 176)  # 3 x (4 + 64) = 204 <= 16 x 13
    assert KVFormat("oaken", 3, 64, 13).record_bytes == 162
    with pytest.raises(ValueError, match="row-0 tails"):
        KVFormat("int8", 3, 64, 0, 13)
    with pytest.raises(ValueError, match="row-0 tails"):
        KVFormat("oaken", 3, 96, 13, 13)
    model = ModelConfig("llama", 64, 9 * 64, 64, 1, 9, 3)
    thresholds = type("T", (), {"sparse_capacity": 13})()
    assert kv_format(model, "oaken", thresholds, block_size=BS).row0_tail == 13
    assert kv_format(model, "oaken", thresholds).row0_tail == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(3, 64), (2, 128)], ids=["d64", "d128"])
def test_kernels_write_and_read_the_tails_as_the_reference(level_kernels, dtype, heads):
    hk, d = heads
    fmt = KVFormat("oaken", hk, d, 7, row0_tail_bytes(hk, d, BS))
    k, v, slots, center = _rows(hk, d, 40, 1)
    ref, ker = _layer(fmt, center), _layer(fmt, center)
    write_quantized(ref, k.to(dtype), v.to(dtype), slots, None)
    write_quantized(ker, k.to(dtype), v.to(dtype), slots, level_kernels.quant)
    assert torch.equal(ref.k_pool, ker.k_pool) and torch.equal(ref.v_pool, ker.v_pool)
    ids = torch.tensor([2, 0, 1, 5])
    for pool, thr in ((ref.k_pool, THR), (ref.v_pool, THR)):
        expected = dequantize_blocks(pool, ids, ref, thr, dtype, None)
        assert torch.equal(dequantize_blocks(pool, ids, ker, thr, dtype, level_kernels.quant), expected)


def test_row0_reads_back_as_the_int8_codec_and_other_rows_as_oaken():
    fmt = KVFormat("oaken", 3, 64, 7, row0_tail_bytes(3, 64, BS))
    k, v, slots, center = _rows(3, 64, 40, 2)
    layer = _layer(fmt, center)
    write_quantized(layer, k, v, slots, None)
    keys = dequantize_blocks(layer.k_pool, torch.arange(BLOCKS), layer, THR, torch.float32, None).flatten(0, 1)
    int8 = fmt.row0_format()
    for i in (0, 1):  # slots 0 and BS: block starts
        expected = int_quant.decode(int_quant.encode((k[i] - center)[None], int8), int8)[0]
        assert torch.equal(keys[slots[i]], expected)
    plain = KVFormat("oaken", 3, 64, 7)
    records, _ = oaken.encode((k[2] - center)[None], THR, plain)
    assert torch.equal(keys[slots[2]], oaken.decode(records, THR, plain)[0])  # slot 2 * BS + 1: Oaken
    assert (keys[0] - (k[0] - center)).abs().max() < 0.25 * (keys[slots[2]] - (k[2] - center)).abs().max()


def test_only_a_block_start_writes_its_tails(level_kernels):
    fmt = KVFormat("oaken", 3, 64, 7, row0_tail_bytes(3, 64, BS))
    k, v, slots, center = _rows(3, 64, 40, 3)
    layer = _layer(fmt, center)
    write_quantized(layer, k[:1], v[:1], slots[:1], level_kernels.quant)  # slot 0
    before = layer.k_pool[0].clone()
    rest = torch.arange(1, BS)
    write_quantized(layer, k[1:BS], v[1:BS], rest, level_kernels.quant)  # the block's other slots
    tails = slice(fmt.body_bytes, fmt.body_bytes + fmt.row0_tail)
    assert torch.equal(layer.k_pool[0, :, tails], before[:, tails])
    assert not torch.equal(layer.k_pool[0, 1:, : fmt.body_bytes], before[1:, : fmt.body_bytes])


def test_tails_move_with_their_block(level_kernels):
    """Copy-on-write and swap copy whole blocks, tails included: a moved block reads the same rows."""
    model = ModelConfig("llama", 64, 9 * 64, 64, 1, 9, 3)
    from kvmosaic.quant import thresholds as kvt

    identity = kvt.ModelIdentity("tiny", "llama", 1, 3, 64, 9 * 64, 64, 0.0)
    thresholds = kvt.KVThresholds(identity, THR.repeat(1, 2, 1), torch.zeros(1, 3, 64), sparse_capacity=7)
    cache = KVCache(model, CacheConfig(num_blocks=BLOCKS, block_size=BS, kv_cache_dtype="oaken", swap_space=0,
                                       num_host_blocks=2), torch.float32, thresholds)
    assert cache.format.row0_tail == 13
    k_pool, v_pool = cache.layer_pools()[0]
    layer = QuantizedKVLayer(k_pool, v_pool, cache.format, THR.clone(), THR.clone())
    k, v, _, _ = _rows(3, 64, BS, 4)
    write_quantized(layer, k, v, torch.arange(BS), level_kernels.quant)  # block 0
    read = lambda block: dequantize_blocks(layer.k_pool, torch.tensor([block]), layer, THR, torch.float32,  # noqa: E731
                                           level_kernels.quant)
    cache.copy([(0, 3)])
    assert torch.equal(read(3), read(0))
    cache.swap_out([(0, 1)])
    cache.swap_in([(1, 4)])
    assert torch.equal(read(4), read(0))
