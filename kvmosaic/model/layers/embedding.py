"""Token embedding over a float table or a quantized one (rows dequantized on lookup)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvmosaic.quant import weights as qw


class RowSource(Protocol):
    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


class TokenEmbedding(nn.Module):
    """``table``: a float [vocab, hidden] tensor, a QuantizedWeight, or a quantized linear method
    (a tied LM head) whose rows are dequantized on lookup: a step reads a few rows, so a float copy
    of the table (113 MB for the default model in float32) would only cost memory."""

    def __init__(self, table: torch.Tensor | qw.QuantizedWeight | RowSource, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.weight = table if isinstance(table, torch.Tensor) else None
        self.source = None if isinstance(table, torch.Tensor) else table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(input_ids, self.weight)
        flat = input_ids.reshape(-1)
        if isinstance(self.source, qw.QuantizedWeight):
            rows = qw.dequantize(self.source.rows(flat), self.dtype)
        else:
            rows = self.source.rows(flat, self.dtype)
        return rows.view(*input_ids.shape, -1)
