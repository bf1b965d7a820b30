"""Token embedding over a float table or a quantized one (rows dequantized on lookup)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvmosaic.quant import weights as qw


class RowSource(Protocol):
    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


def _float_rows(table: torch.Tensor) -> Callable[[torch.Tensor, torch.dtype], torch.Tensor]:
    return lambda index, dtype: F.embedding(index, table)


def _quantized_rows(table: qw.QuantizedWeight) -> Callable[[torch.Tensor, torch.dtype], torch.Tensor]:
    return lambda index, dtype: qw.dequantize(table.rows(index), dtype)


class TokenEmbedding(nn.Module):
    """``table``: a float [vocab, hidden] tensor, a QuantizedWeight, or a quantized linear method
    (a tied LM head) whose rows are dequantized on lookup: a step reads a few rows, so a float copy
    of the table (113 MB for the default model in float32) would only cost memory."""

    def __init__(self, table: torch.Tensor | qw.QuantizedWeight | RowSource, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._source = table
        self.weight = table if isinstance(table, torch.Tensor) else None  # the float table, when there is one
        if isinstance(table, torch.Tensor):
            self._rows = _float_rows(table)
        elif isinstance(table, qw.QuantizedWeight):
            self._rows = _quantized_rows(table)
        else:
            self._rows = table.rows

    def kernel_table(self) -> list[torch.Tensor] | None:
        """The table as the kernels look rows up in it (``ops.decode_passes``): [a float table], or a
        packed quantized head's [codes, scales, extra]; None when only Python can read it."""
        if self.weight is not None:
            return [self.weight] if self.weight.dtype == self.dtype else None
        packed = getattr(self._source, "stack_weights", None)
        parts = packed() if packed is not None else None
        return None if parts is None else list(parts)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._rows(input_ids.reshape(-1), self.dtype).view(*input_ids.shape, -1)
