"""SwiGLU activation over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2F] laid out as (gate | up) -> silu(gate) * up, [N, F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
