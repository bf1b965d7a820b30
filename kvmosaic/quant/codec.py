"""One entry point per direction over every quantized KV format (the PyTorch reference path)."""

from __future__ import annotations

import torch

from kvmosaic.quant import int_quant, oaken
from kvmosaic.quant.format import KVFormat


def encode_rows(x: torch.Tensor, fmt: KVFormat, thresholds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V rows [N, Hk, D] -> (records [N, record_bytes] uint8, outliers folded into the middle)."""
    if fmt.mode == "oaken":
        if thresholds is None:
            raise ValueError("oaken needs the layer's thresholds")
        return oaken.encode(x, thresholds, fmt)
    if fmt.mode == "bf16":
        return x.float().to(torch.bfloat16).contiguous().view(torch.uint8).flatten(1), torch.zeros((), dtype=torch.long)
    return int_quant.encode(x, fmt), torch.zeros((), dtype=torch.long)


def decode_rows(records: torch.Tensor, fmt: KVFormat, thresholds: torch.Tensor | None = None) -> torch.Tensor:
    """Records [N, record_bytes] -> float32 rows [N, Hk, D]."""
    if fmt.mode == "oaken":
        if thresholds is None:
            raise ValueError("oaken needs the layer's thresholds")
        return oaken.decode(records, thresholds, fmt)
    if fmt.mode == "bf16":
        return records.contiguous().view(torch.bfloat16).float().view(records.shape[0], fmt.num_kv_heads, fmt.head_dim)
    return int_quant.decode(records, fmt)
