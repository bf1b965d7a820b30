"""SwiGLU activation over a fused gate/up projection (compiled kernel or PyTorch reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmosaic.ops import get_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2F] laid out as (gate | up) -> silu(gate) * up, [N, F]."""
    ops = get_ops()
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
