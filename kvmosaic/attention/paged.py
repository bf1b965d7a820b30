"""Paged attention over a packed batch of variable-length sequences.

The batch holds ``num_decode_tokens`` single-token decodes first, then prefill
chunks back to back; nothing is padded to the longest request. New K/V are
written into the paged cache through ``slot_mapping`` and attention then reads
each sequence's context from its blocks.

GQA is handled by grouping: the ``g = Hq / Hkv`` query heads that share a KV
head are laid out as extra query rows of that KV head, so K/V are never
repeated per query head.

Two backends: ``KernelAttention`` runs the compiled kernels of ``kvmosaic.ops`` (rotary + cache
write in one pass; decode and prefill attention reading blocks in place, with an online softmax),
``ReferenceAttention`` the pure PyTorch path they are tested against.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvmosaic.attention.backend import AttentionBackend, DecodePasses, LayerStack
from kvmosaic.attention.merge import PartialAttention
from kvmosaic.attention.metadata import AttentionMetadata, PrefillSpan, build_causal_mask
from kvmosaic.attention.pool_rows import gather_blocks, gathered_partial
from kvmosaic.attention.rotary import RotaryEmbedding
from kvmosaic.config import ModelConfig

if TYPE_CHECKING:
    from kvmosaic.attention.kv_cache import KVCache

QUERY_CHUNK = 64  # prefill queries per SDPA call when a chunk is long


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows ([N, Hk, D]) into their cache slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    d, hq, dim = q.shape
    _, block_size, hk, _ = k_cache.shape
    tables = meta.decode_block_tables
    # index_select copies whole blocks (contiguous rows): far cheaper than advanced indexing
    context = tables.shape[1] * block_size
    k = k_cache.index_select(0, tables.flatten()).view(d, context, hk, dim).transpose(1, 2)
    v = v_cache.index_select(0, tables.flatten()).view(d, context, hk, dim).transpose(1, 2)
    q = q.view(d, hk, hq // hk, dim)
    mask = meta.decode_mask
    if mask is None:  # the C++ kernels never need it, so the runner leaves it to this path
        mask = (torch.arange(context)[None, :] < meta.decode_context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(d, hq, dim)


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       span: PrefillSpan, scale: float) -> torch.Tensor:
    n, hq, dim = q.shape
    hk = k_cache.shape[2]
    g = hq // hk
    k = k_cache.index_select(0, span.block_table).flatten(0, 1)[: span.context_len].transpose(0, 1)
    v = v_cache.index_select(0, span.block_table).flatten(0, 1)[: span.context_len].transpose(0, 1)
    # rows ordered (token, group) within each KV head; 4-D inputs keep SDPA on its flash kernel
    q = q.view(n, hk, g, dim).transpose(0, 1).reshape(1, hk, n * g, dim)
    k, v = k[None], v[None]
    start = span.context_len - n
    if span.mask is None:  # built once, then reused by every layer
        span.mask = build_causal_mask(start, n, g)
    if n <= QUERY_CHUNK:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scale)
    else:
        # Query chunks attend only to the keys they can see: skips most of the masked upper triangle.
        parts = []
        for c0 in range(0, n, QUERY_CHUNK):
            c1 = min(n, c0 + QUERY_CHUNK)
            visible = start + c1
            rows = slice(c0 * g, c1 * g)
            parts.append(F.scaled_dot_product_attention(
                q[:, :, rows], k[:, :, :visible], v[:, :, :visible],
                attn_mask=span.mask[rows, :visible], scale=scale))
        out = torch.cat(parts, dim=2)
    return out.view(hk, n, g, dim).transpose(0, 1).reshape(n, hq, dim)


def rotate_and_cache_reference(qkv: torch.Tensor, rotary: RotaryEmbedding, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                               num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Split a fused qkv projection [N, (Hq + 2 Hk) * D], rotate q and k, write k and v into their
    cache slots. Returns the rotated q as [N, Hq, D]."""
    n, head_dim = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = rotary.apply(rotary.tables(positions), q.reshape(n, num_heads, head_dim),
                        k.reshape(n, num_kv_heads, head_dim))
    write_kv(k_cache, v_cache, k, v.reshape(n, num_kv_heads, head_dim), slot_mapping)
    return q


def rotate_and_cache_kernel(ops: ModuleType, qkv: torch.Tensor, rotary: RotaryEmbedding, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                            num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """``rotate_and_cache_reference`` in one kernel pass."""
    return ops.rope_and_cache(qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, slot_mapping,
                              num_heads, num_kv_heads)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [N, Hq, D] (this step's K/V already in the cache); caches: [num_blocks, block_size, Hk, D].
    Returns [N, Hq, D]."""
    nd = meta.num_decode_tokens
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale)
    for span in meta.prefills:
        sl = slice(span.token_start, span.token_start + span.num_tokens)
        out[sl] = _prefill_attention(q[sl], k_cache, v_cache, span, scale)
    return out


def paged_attention_kernel(ops: ModuleType, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """``paged_attention_reference`` on the kernels (prefill chunks of head sizes the prefill kernel
    does not cover run the reference)."""
    nd = meta.num_decode_tokens
    if nd == q.shape[0]:  # pure decode batch: no output stitching needed
        return ops.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                          meta.decode_context_lens, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = ops.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                              meta.decode_context_lens, scale)
    prefill_kernel = ops.prefill_attention_supports(q.shape[-1])
    for span in meta.prefills:
        sl = slice(span.token_start, span.token_start + span.num_tokens)
        if prefill_kernel:  # writes the chunk's rows of out in place
            ops.paged_prefill_attention(q[sl], k_cache, v_cache, span.block_table, span.context_len, scale, out[sl])
        else:
            out[sl] = _prefill_attention(q[sl], k_cache, v_cache, span, scale)
    return out


class ReferenceAttention(AttentionBackend):
    """A compute-dtype cache (``kv_cache_dtype="auto"``) on the PyTorch reference path."""

    def __init__(self, model: ModelConfig, kv_cache: KVCache) -> None:
        super().__init__(model, kv_cache)
        self.layers = kv_cache.layer_pools()  # per layer [2, num_blocks, block_size, Hk, D]
        self.ops: ModuleType | None = None  # the float kernels (KernelAttention), or None

    def lendable_rows(self) -> FloatPoolRows:
        return FloatPoolRows(self)

    def rotate_and_cache(self, qkv: torch.Tensor, rotary: RotaryEmbedding, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotate and write into any cache-shaped target (the layer's, or a scratch one)."""
        return rotate_and_cache_reference(qkv, rotary, k_cache, v_cache, positions, slot_mapping,
                                          self.num_heads, self.num_kv_heads)

    def write(self, layer: int, qkv: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata) -> torch.Tensor:
        cache = self.layers[layer]
        return self.rotate_and_cache(qkv, rotary, cache[0], cache[1], meta.positions, meta.slot_mapping)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        cache = self.layers[layer]
        return paged_attention_reference(q, cache[0], cache[1], meta, self.scale)


class KernelAttention(ReferenceAttention):
    """A compute-dtype cache on the C++ kernels; a step can run all layers in one call."""

    def __init__(self, model: ModelConfig, kv_cache: KVCache, ops: ModuleType) -> None:
        super().__init__(model, kv_cache)
        self.ops: ModuleType = ops
        self._spans_on_kernel = ops.prefill_attention_supports(model.head_dim)
        self._stack_caches = ops.StackCaches(self.layers)  # checked once for every layer_stack call

    def rotate_and_cache(self, qkv: torch.Tensor, rotary: RotaryEmbedding, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        return rotate_and_cache_kernel(self.ops, qkv, rotary, k_cache, v_cache, positions, slot_mapping,
                                       self.num_heads, self.num_kv_heads)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        cache = self.layers[layer]
        return paged_attention_kernel(self.ops, q, cache[0], cache[1], meta, self.scale)

    def layer_stack(self) -> LayerStack | None:
        return self._layer_stack if hasattr(self.ops, "layer_stack") else None

    def decode_passes(self) -> DecodePasses | None:
        return self._decode_passes if hasattr(self.ops, "decode_passes") else None

    def _decode_passes(self, input_ids: torch.Tensor, dtype: torch.dtype, weights: object, rotary: RotaryEmbedding,
                       positions: torch.Tensor, block_tables: torch.Tensor, embedding: list[torch.Tensor],
                       stop_ids: list[int], passes: int, eps: float) -> torch.Tensor:
        return self.ops.decode_passes(input_ids, dtype, weights, self._stack_caches, positions, rotary.cos, rotary.sin,
                                      block_tables, embedding, stop_ids, passes, self.num_heads, self.num_kv_heads,
                                      eps, self.scale)

    def _layer_stack(self, residual: torch.Tensor, weights: object, rotary: RotaryEmbedding,
                     meta: AttentionMetadata, eps: float,
                     keep_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if meta.prefills and not self._spans_on_kernel:
            return None
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if tables is None:
            tables, lens = _NO_DECODE_TABLES, _NO_DECODE_LENS
        spans = _NO_SPANS
        if meta.prefills:
            spans = torch.tensor([(p.token_start, p.num_tokens, p.context_len) for p in meta.prefills],
                                 dtype=torch.long)
        return self.ops.layer_stack(residual, weights, self._stack_caches, meta.positions, rotary.cos, rotary.sin,
                                    meta.slot_mapping, tables, lens, spans, [p.block_table for p in meta.prefills],
                                    keep_rows, self.num_heads, self.num_kv_heads, eps, self.scale)


class FloatPoolRows:
    """A float cache lent as rows: written, gathered and attended over in place."""

    def __init__(self, local: ReferenceAttention) -> None:
        self.local = local

    def rotate_and_write(self, layer, qkv, rotary, positions, slots):
        k_cache, v_cache = self.local.layers[layer]
        return self.local.rotate_and_cache(qkv, rotary, k_cache, v_cache, positions, slots)

    def rotate(self, qkv, rotary, positions):
        # the cache-writing kernel into a scratch "cache" of one-token blocks
        n, local = qkv.shape[0], self.local
        k = torch.empty(n, 1, local.num_kv_heads, local.head_dim, dtype=local.layers[0].dtype)
        v = torch.empty_like(k)
        q = local.rotate_and_cache(qkv, rotary, k, v, positions, torch.arange(n))
        return q, k[:, 0], v[:, 0]

    def write(self, layer, k, v, slots):
        k_cache, v_cache = self.local.layers[layer]
        hk, dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, hk, dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, hk, dim).index_copy_(0, slots, v.to(v_cache.dtype))

    def gather(self, layer, block_ids, dtype):
        k_cache, v_cache = self.local.layers[layer]
        return gather_blocks(k_cache, block_ids).to(dtype), gather_blocks(v_cache, block_ids).to(dtype)

    def partial(self, layer, q, q_pos, block_ids, k_pos, scale):
        """A decode row (one query, the blocks' first slots up to its position visible) runs the decode
        attention kernel over the blocks in place, returning its partial sums; anything else, or no
        kernel, gathers the rows and attends in PyTorch."""
        k_cache, v_cache = self.local.layers[layer]
        ops = self.local.ops
        kernel = None if ops is None else ops.paged_decode_attention_partial
        if (kernel is None or q.shape[0] != 1 or q.dtype != k_cache.dtype or q.shape[-1] not in (64, 128)
                or not len(block_ids)):
            return gathered_partial(self, layer, q, q_pos, block_ids, k_pos, scale)
        visible = torch.searchsorted(k_pos, q_pos[:1], right=True)  # k_pos ascends: a prefix is visible
        return PartialAttention(*kernel(q.contiguous(), k_cache, v_cache, block_ids[None], visible, scale))

    def open_decode_lane(self, opener):
        return opener.float_pool(self.local.layers, self.local.num_heads, self.local.ops)

    @property
    def float_ops(self):
        return self.local.ops




_NO_DECODE_TABLES = torch.zeros((0, 1), dtype=torch.long)
_NO_DECODE_LENS = torch.zeros(0, dtype=torch.long)
_NO_SPANS = torch.zeros((0, 3), dtype=torch.long)
