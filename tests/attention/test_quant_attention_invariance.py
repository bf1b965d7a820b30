"""Batch invariance with a KV cache of byte records (bf16, int8, int4, Oaken): through the quantized backend, a
query row's attention is the same bits whether the decode kernel computes it over the records (alone,
in any batch, at any thread count) or a prefill chunk does over the dequantized blocks (the whole
prompt or any chunk of it), on every ISA level built here, across the 256-token segments."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.attention.metadata import AttentionMetadata, PrefillSpan
from kvmosaic.attention.quantized import QuantizedKVLayer, paged_attention_quantized, write_quantized
from kvmosaic.quant.format import KVFormat, row0_tail_bytes

BS = 16  # the runner's block size
CTX = 530
CONTEXTS = [1, 7, 16, 40, 255, 256, 257, 300, 530]
THR = (torch.tensor([-2.2, -0.06, 0.05, 2.0]), torch.tensor([-1.8, -0.04, 0.04, 1.9]))
MODES = ["bf16", "int8", "int4", "oaken", "oaken-row0"]  # oaken-row0: each block's row 0 from its records' tails
DTYPES = [torch.float32, torch.bfloat16]


def _layer(mode: str, hk: int, d: int, blocks: int, fmt: KVFormat | None = None) -> QuantizedKVLayer:
    if mode == "oaken-row0":
        fmt = KVFormat("oaken", hk, d, 7, row0_tail_bytes(hk, d, BS))
    fmt = fmt or KVFormat(mode, hk, d, 7 if mode == "oaken" else 0)
    pools = torch.zeros(2, blocks, BS, fmt.record_bytes, dtype=torch.uint8)
    layer = QuantizedKVLayer(pools[0], pools[1], fmt)
    if fmt.mode == "oaken":
        layer.k_thresholds, layer.v_thresholds = THR
    return layer


def _filled(kernels, mode: str, hk: int, d: int, dtype: torch.dtype, seed: int, fmt: KVFormat | None = None):
    """A layer holding CTX tokens in shuffled blocks, its block table and CTX query rows."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-CTX // BS)
    layer = _layer(mode, hk, d, blocks + 3, fmt)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].long()
    k, v = torch.randn(CTX, hk, d, generator=gen), torch.randn(CTX, hk, d, generator=gen)
    k[:, :, 3] *= 6  # a large channel, like real keys (Oaken outliers)
    slots = table[torch.arange(CTX) // BS] * BS + torch.arange(CTX) % BS
    write_quantized(layer, k.to(dtype), v.to(dtype), slots, kernels.quant)
    q = torch.randn(CTX, 3 * hk, d, generator=gen).to(dtype)
    return layer, table, q


def _decode_meta(lens: list[int], table: torch.Tensor) -> AttentionMetadata:
    """Decode rows as the runner packs them: no mask (the kernels do not read it), lengths given."""
    return AttentionMetadata(torch.zeros(0, dtype=torch.long), len(lens), table[None].repeat(len(lens), 1), None,
                             decode_context_lens=torch.tensor(lens))


def _prefill_span(token_start: int, first: int, last: int, table: torch.Tensor) -> PrefillSpan:
    """Tokens [first, last) of the prompt as a chunk over context [0, last)."""
    return PrefillSpan(token_start, last - first, last, table[: -(-last // BS)], None)


def _prefill(kernels, q, layer, first: int, last: int, table: torch.Tensor) -> torch.Tensor:
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 0, None, None, [_prefill_span(0, first, last, table)])
    return paged_attention_quantized(q[first:last].contiguous(), layer, meta, q.shape[-1]**-0.5, kernels)


def _decode(kernels, q, layer, lens: list[int], table: torch.Tensor) -> torch.Tensor:
    rows = torch.stack([q[n - 1] for n in lens]).contiguous()  # the row at position n - 1 sees n keys
    return paged_attention_quantized(rows, layer, _decode_meta(lens, table), q.shape[-1]**-0.5, kernels)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(3, 64), (2, 128)], ids=["d64", "d128"])
def test_decode_rows_equal_prefill_rows(level_kernels, mode, dtype, heads):
    hk, d = heads
    layer, table, q = _filled(level_kernels, mode, hk, d, dtype, 1)
    whole = _prefill(level_kernels, q, layer, 0, CTX, table)
    for c in CONTEXTS:
        alone = _decode(level_kernels, q, layer, [c], table)
        assert torch.equal(alone[0], whole[c - 1]), f"context {c}"
        # first and in the middle of a batch of other lengths
        batch = _decode(level_kernels, q, layer, [c, 3, CTX, c, 1, 290], table)
        assert torch.equal(batch[0], alone[0]) and torch.equal(batch[3], alone[0]), f"context {c}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunks_and_mixed_steps_equal_the_whole_prompt(level_kernels, mode, dtype):
    layer, table, q = _filled(level_kernels, mode, 3, 64, dtype, 2)
    whole = _prefill(level_kernels, q, layer, 0, CTX, table)
    for first, last in [(0, 100), (100, 257), (257, 258), (258, CTX), (511, CTX)]:
        assert torch.equal(_prefill(level_kernels, q, layer, first, last, table), whole[first:last]), (first, last)
    # one step of two decode rows and a chunk, as the runner packs a mixed batch
    lens, (first, last) = [300, 40], (200, 290)
    rows = torch.cat([torch.stack([q[n - 1] for n in lens]), q[first:last]]).contiguous()
    meta = _decode_meta(lens, table)
    meta.prefills = [_prefill_span(len(lens), first, last, table)]
    out = paged_attention_quantized(rows, layer, meta, 64**-0.5, level_kernels)
    assert torch.equal(out[0], whole[299]) and torch.equal(out[1], whole[39])
    assert torch.equal(out[2:], whole[first:last])


@pytest.mark.parametrize("mode", MODES)
def test_decode_rows_do_not_depend_on_the_thread_count(level_kernels, mode):
    layer, table, q = _filled(level_kernels, mode, 3, 64, torch.float32, 3)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(_decode(level_kernels, q, layer, [300, 40], table))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("mode", MODES)
def test_a_lone_holders_partial_is_its_decode_row(level_kernels, mode):
    """The partial form (DistAttention, decode lanes) of the one holder of a row's keys gives its row."""
    layer, table, q = _filled(level_kernels, mode, 3, 64, torch.float32, 4)
    args = (layer.args()[0], layer.fmt.num_kv_heads, layer.fmt.sparse_capacity, layer.k_thresholds,
            layer.v_thresholds, 64**-0.5)
    for c in (40, 300):
        out, ref, total = level_kernels.quant.quant_decode_attention_partial(
            q[c - 1:c].contiguous(), layer.k_pool, layer.v_pool, table[None], torch.tensor([c]), *args)
        row = _decode(level_kernels, q, layer, [c], table)
        torch.testing.assert_close(out, row, rtol=1e-6, atol=1e-7)
        assert torch.isfinite(ref).all() and (total > 0).all()
    out, ref, total = level_kernels.quant.quant_decode_attention_partial(
        q[:1].contiguous(), layer.k_pool, layer.v_pool, table[None], torch.tensor([0]), *args)
    assert (out == 0).all() and (ref == float("-inf")).all() and (total == 0).all()  # no keys


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_groups_decode_rows_equal_prefill_rows(level_kernels, dtype):
    """group_size 16 (sub-vectors as heads): decodes attend over the dequantized blocks on the float
    decode kernel, the prefill kernel's arithmetic."""
    from kvmosaic.attention.kv_cache import kv_format
    from kvmosaic.config import ModelConfig

    fmt = kv_format(ModelConfig("llama", 100, 9 * 64, 4 * 64, 1, 9, 3), "int4", group_size=16)
    layer, table, q = _filled(level_kernels, "int4", 3, 64, dtype, 5, fmt)
    whole = _prefill(level_kernels, q, layer, 0, CTX, table)
    for c in (7, 257, 300):
        assert torch.equal(_decode(level_kernels, q, layer, [c, 40], table)[0], whole[c - 1]), c
