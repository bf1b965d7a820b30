"""Oaken's key rotation: keys are quantized in a rotated, rescaled basis, queries meet them there.

A few key channels carry most of a head's magnitude (rotary pairs with large, slowly turning
values), so a per-token 4-bit scale spent on them leaves coarse levels for the rest. Before a key is
encoded, its layer's center c is subtracted, each channel i is divided by a calibrated scale s_i
(the channel's RMS over the calibration text to the power ``exponent``, normalised to a geometric
mean of 1 per head) and the vector is rotated by a Walsh-Hadamard matrix H with fixed random signs
D (``k' = H D ((k - c) / s) / sqrt(d)``). Queries are multiplied by s instead of divided and rotated
alike (``q' = H D (q * s) / sqrt(d)``), so ``q' . k' = q . (k - c)`` for any H D orthogonal: the
scores are unchanged and attention reads the rotated keys with no way back. Values are not rotated
(measured: no gain). The rotation spreads every channel's energy over all of them, so the groups,
scales and outliers Oaken fits per token see flatter vectors.

Signs, scales and the 1/sqrt(d) fold into one weight per KV head and channel; the rotation is the
in-place butterfly, stride 1 first, each row alone in float32 (this module is the reference of the
kernel ``rotate_heads``, which matches it bit for bit). No product of rows with a matrix is taken, so
a row's rotated values do not depend on how many rows share the call (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

DEFAULT_EXPONENT = 0.5
DEFAULT_SEED = 1


def random_signs(head_dim: int, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """The fixed +-1 signs of a rotation, [head_dim] float32."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (head_dim,), generator=generator).float() * 2 - 1


def channel_scales(keys: torch.Tensor, exponent: float) -> torch.Tensor:
    """Per KV head and channel scales from centered keys [N, Hk, D]: RMS ** exponent, normalised to a
    geometric mean of 1 over each head's channels. [Hk, D] float32."""
    rms = keys.float().pow(2).mean(0).sqrt().clamp_min(1e-6)
    scale = rms ** exponent
    return scale / scale.log().mean(-1, keepdim=True).exp()


def butterfly(x: torch.Tensor) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard transform of x's last dimension (a power of two), stride 1 first."""
    shape, d = x.shape, x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the rotation needs a power-of-two head size, got {d}")
    stride = 1
    while stride < d:
        pairs = x.reshape(-1, d // (2 * stride), 2, stride)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).reshape(shape)
        stride *= 2
    return x


def rotate_heads_reference(x: torch.Tensor, weight: torch.Tensor, center: torch.Tensor | None,
                           dtype: torch.dtype) -> torch.Tensor:
    """x [N, H, D] -> [N, H, D] in ``dtype``: each head vector of group h // (H / G) centered (center
    [G, D]), weighted (weight [G, D]) and put through the butterfly, in float32."""
    n, heads, d = x.shape
    groups = weight.shape[0]
    y = x.float().view(n, groups, heads // groups, d)
    if center is not None:
        y = y - center[:, None]
    y = y * weight[:, None]
    return butterfly(y).view(n, heads, d).to(dtype)


@dataclass(frozen=True, slots=True)
class KeyRotation:
    """One layer's rotation: keys and queries into the basis the cache stores keys in."""

    key_weight: torch.Tensor  # [Hk, D]: signs / (scale * sqrt(D))
    query_weight: torch.Tensor  # [Hk, D]: signs * scale / sqrt(D)
    center: torch.Tensor  # [Hk, D]

    @classmethod
    def of(cls, signs: torch.Tensor, scale: torch.Tensor, center: torch.Tensor) -> KeyRotation:
        norm = scale.shape[-1] ** -0.5
        return cls((signs / scale * norm).contiguous(), (signs * scale * norm).contiguous(),
                   center.float().contiguous())

    def keys(self, k: torch.Tensor, qops: ModuleType | None) -> torch.Tensor:
        """Rotated keys [N, Hk, D] in float32 (what the encoder takes)."""
        if qops is None:
            return rotate_heads_reference(k, self.key_weight, self.center, torch.float32)
        return qops.rotate_heads(k, self.key_weight, self.center, torch.float32)

    def queries(self, q: torch.Tensor, qops: ModuleType | None) -> torch.Tensor:
        """Rotated queries [N, Hq, D] in their own dtype (what attention takes)."""
        if qops is None:
            return rotate_heads_reference(q, self.query_weight, None, q.dtype)
        return qops.rotate_heads(q, self.query_weight, _NO_CENTER, q.dtype)

    def unrotate_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Stored keys [N, Hk, D] back to centered keys, in their dtype: the butterfly is its own inverse
        up to a factor d, so ``k - c = butterfly(k') * query_weight``."""
        return (butterfly(k.float()) * self.query_weight).to(k.dtype)


_NO_CENTER = torch.zeros(0)
