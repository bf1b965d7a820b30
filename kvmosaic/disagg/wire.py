"""How a prompt's K/V travels between a prefill and a decode worker (pure functions).

``auto``: in the cache's own layout and format (float, or the records of a quantized cache): exact,
and a quantized cache is already small. ``int8``: a float cache's values as int8 records per token
and KV head (asymmetric, fp16 lo and scale, the int8 KV cache's own codec), 68 bytes a head vector
of 64 instead of 256 in float32 (128 in bf16); the decode side decodes them back to the pool's dtype.
A quantized cache always travels as its records."""

from __future__ import annotations

import dataclasses

import torch

from kvmosaic.config import check_kv_transfer_dtype
from kvmosaic.disagg.prefix import PrefixKV
from kvmosaic.quant import int_quant
from kvmosaic.quant.format import KVFormat


def _is_float(kv: PrefixKV) -> bool:
    return isinstance(kv.data, torch.Tensor) and kv.data.is_floating_point()


def encode(kv: PrefixKV, transfer_dtype: str) -> PrefixKV:
    """The K/V as it is sent: float [layers, 2, blocks, block_size, heads, dim] becomes int8 records
    [layers, 2, blocks, block_size, heads * (4 + dim)] under ``int8``; anything else goes as it is."""
    check_kv_transfer_dtype(transfer_dtype)
    if transfer_dtype == "auto" or not _is_float(kv):
        return kv
    *lead, heads, dim = kv.data.shape
    records = int_quant.encode(kv.data.reshape(-1, heads, dim), KVFormat("int8", heads, dim))
    dtype = str(kv.data.dtype).removeprefix("torch.")
    return dataclasses.replace(kv, data=records.reshape(*lead, -1), wire=f"int8:{heads}x{dim}:{dtype}")


def decode(kv: PrefixKV) -> PrefixKV:
    """The K/V in the cache's layout and dtype again."""
    if kv.wire == "auto":
        return kv
    shape, dtype = kv.wire.removeprefix("int8:").split(":")
    heads, dim = (int(n) for n in shape.split("x"))
    *lead, _ = kv.data.shape
    rows = int_quant.decode(kv.data.reshape(-1, kv.data.shape[-1]), KVFormat("int8", heads, dim))
    return dataclasses.replace(kv, data=rows.reshape(*lead, heads, dim).to(getattr(torch, dtype)), wire="auto")
