"""SwiGLU activation over a fused gate/up projection."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor, ops: ModuleType | None = None) -> torch.Tensor:
    """[N, 2F] laid out as (gate | up) -> silu(gate) * up, [N, F]. One fused pass with the float kernels ``ops``."""
    if ops is not None and gate_up.dim() == 2 and gate_up.dtype in (torch.float32, torch.bfloat16):
        return ops.silu_and_mul(gate_up)
    return silu_and_mul_reference(gate_up)
