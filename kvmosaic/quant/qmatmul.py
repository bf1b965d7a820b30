"""The product of activations and a quantized weight, in PyTorch: the reference of ``ops.quantized_linear``.

It follows the kernel's arithmetic at every row count: the activations are quantized to
int8 per 32 values (d = max|x| / 127, codes rounded half to even) and each weight block is an integer
dot product (exact in float32: |sum| < 2^24), scaled per block:
    out[m, n] = sum_b scale[n, b] d[m, b] isum[m, n, b] + min[n, b] d[m, b] xsum[m, b]
(a q6 weight's isum weighs each 16 codes by their int8 scale sc, and its scale is the super-block's d:
the integer sum stays below 2^24, so this is still exact; a q4k weight's scale d * sc and min (-dmin) * m
are exact float32 products, so it is the q4 weight ``as_q4`` makes)
summed block after block with one rounding per multiply-add, as the kernel's fused multiply-adds
do, so the two agree bit for bit (float64 carries each product exactly; rounding it and the sum to
float32 differs from a single rounding only in double-rounding ties, vanishingly rare). That matters:
rounding activations to int8 makes the model chaotic (one code flipped by a 1-ulp difference
upstream moves later logits by ~0.5), so a reference that is merely close would not give the same
greedy tokens.
"""

from __future__ import annotations

import torch

from kvmosaic.quant.composite import CompositeWeight
from kvmosaic.quant.weights import BLOCK, SUB, SUPER, QuantizedWeight, as_q4, codes_of


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> codes [M, K / 32, 32] (integral float32), d [M, K / 32], d * sum(codes) [M, K / 32]."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))
    codes = torch.round(blocks * inverse.unsqueeze(-1))
    return codes, d, d * codes.sum(-1)


def quantized_matmul_int8(x: torch.Tensor, weight: QuantizedWeight | CompositeWeight,
                          rows_per_pass: int = 64) -> torch.Tensor:
    """The kernel's arithmetic in float32 [M, N], ``rows_per_pass`` rows at a time (bounded memory); a
    composite's columns are its parts' products side by side."""
    if isinstance(weight, CompositeWeight):
        return torch.cat([quantized_matmul_int8(x, p, rows_per_pass) for p in weight.parts], dim=1)
    n, _ = weight.shape
    if weight.kind == "q4k":
        weight = as_q4(weight)
    wq, block_scale = _integer_blocks(weight)
    mins = None if weight.min is None else weight.min.float()
    parts = []
    for chunk in x.split(rows_per_pass):
        xq, d, xsum = quantize_activations(chunk)
        isum = torch.einsum("mbk,nbk->mnb", xq, wq)  # integers below 2^24: exact
        scale = block_scale.unsqueeze(0) * d.unsqueeze(1)  # [M, N, B], float32 products as the kernel's
        acc = torch.zeros(chunk.shape[0], n, dtype=torch.float64)
        for b in range(isum.shape[-1]):
            acc = _fma(isum[..., b], scale[..., b], acc)
            if mins is not None:
                acc = _fma(mins[:, b].unsqueeze(0), xsum[:, b].unsqueeze(1), acc)
        parts.append(acc.float())
    return torch.cat(parts) if parts else torch.zeros(0, n)


def _integer_blocks(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer weights [N, K / 32, 32] (as float32) and their float scale per 32 [N, K / 32]."""
    n, _ = weight.shape
    codes = codes_of(weight).float()
    if weight.kind != "q6":
        return codes.view(n, -1, BLOCK), weight.scale.float()
    scaled = codes.view(n, -1, SUB) * weight.scale.float().unsqueeze(-1)  # q * sc: |.| <= 4096
    return scaled.view(n, -1, BLOCK), weight.super_scale.repeat_interleave(SUPER // BLOCK, dim=1)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c with one rounding (emulated in float64, where a * b is exact)."""
    return (a.double() * b.double() + c).float().double()


def quantized_linear_reference(x: torch.Tensor, weight: QuantizedWeight | CompositeWeight,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ weight^T (+ bias) in x's dtype."""
    out = quantized_matmul_int8(x, weight)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
