"""int8 / int4 KV quantization: per token and per KV head, asymmetric (fp16 lo + fp16 scale).

``x ~ lo + code * scale`` with ``lo = min(x)`` and ``scale = (max(x) - lo) / (2^bits - 1)``, both
rounded to fp16 (the scale slightly upwards so the largest value stays reachable). Codes round to
nearest, ties to even.
"""

from __future__ import annotations

import torch

from kvmosaic.quant.format import (
    INT_HEADER_BYTES,
    KVFormat,
    fp16_bytes,
    fp16_scale,
    pack_nibbles,
    read_fp16,
    safe_divisor,
    unpack_nibbles,
)


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D], lo fp16 [...], scale fp16 [...])."""
    levels = 2**bits - 1
    x = x.float()
    lo = x.amin(-1).to(torch.float16)
    scale = fp16_scale(x.amax(-1) - lo.float(), levels)
    codes = ((x - lo.float()[..., None]) / safe_divisor(scale.float())[..., None]).round_().clamp_(0, levels)
    return codes.to(torch.uint8), lo, scale


def dequantize(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return lo.float()[..., None] + codes.float() * scale.float()[..., None]


def encode(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows [N, Hk, D] -> records [N, record_bytes] uint8."""
    codes, lo, scale = quantize(x, fmt.bits)
    if fmt.bits == 4:
        codes = pack_nibbles(codes)
    header = fp16_bytes(torch.stack((lo, scale), dim=-1))
    return torch.cat((header, codes), dim=-1).flatten(1)


def decode(records: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Records [N, record_bytes] -> float32 rows [N, Hk, D]."""
    per_head = records.view(records.shape[0], fmt.num_kv_heads, INT_HEADER_BYTES + fmt.code_bytes)
    lo, scale = read_fp16(per_head[..., :INT_HEADER_BYTES]).unbind(-1)
    codes = per_head[..., INT_HEADER_BYTES:]
    if fmt.bits == 4:
        codes = unpack_nibbles(codes)
    return dequantize(codes, lo, scale)
