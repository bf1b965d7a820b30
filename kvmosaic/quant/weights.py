"""Quantized linear weights: GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K as pure tensor functions.

Four in-memory kinds, whatever the GGUF type they came from:

* ``q8``: int8 codes [N, K] and one scale per 32 weights: w = scale * q.
* ``q4``: uint8 [N, K / 2], 16 bytes per 32 weights (byte j: weight j in the low nibble, weight
  j + 16 in the high one, GGUF's Q4_0 order) and a scale and a min per 32 weights: w = scale * q + min.
  Q4_0 is min = -8 d.
* ``q4k`` (Q4_K): q4's codes, a uint8 scale sc and min m (6 bits each) per 32 weights and per 256 a
  float16 pair (d, -dmin) (``super_scale`` [N, K / 128]: d of super-block s at 2 s, -dmin at 2 s + 1):
  w = (d * sc) * q + (-dmin) * m: 4.625 bits a weight as held (the file's 4.5 with its 6-bit sc and m
  unpacked to a byte each). The products d * sc and (-dmin) * m are exact in float32 (11 + 6 bits),
  so they are the scale and min a ``q4`` weight with float32 scales would hold: products are the same.
* ``q6`` (Q6_K): int8 codes q in [-32, 31] [N, K], an int8 scale sc per 16 weights and a float32 d
  per 256 (``super_scale``): w = (d * sc) * q. In the kernels' layout the codes take 6 bits.

Scales and mins keep the narrowest dtype that is exact: float16 for Q8_0, Q4_0 and Q4_1 (their d and
m are float16 in the file and -8 d is exact), float32 where a q4k weight widens to q4 (``as_q4``: its
d * sc needs up to 17 mantissa bits). So every dequantized value equals ``gguf.quants.dequantize`` bit
for bit, and the default model's Q4_1 stays at 20 bytes per 32 weights instead of the 24 a float32
scale and min would take.

GGUF types with no kernel of their own (Q5_0, Q5_1, Q2_K, Q3_K and Q5_K: 2 to 5 bits a weight)
are requantized to Q8_0 at load (``requantize``): 8.5 bits a weight instead of a float copy, and an
error of about half a Q8_0 step per weight: a sixteenth of a 5-bit type's own step, less for fewer bits.

Fused parts of different kinds stay in their kinds side by side (``concat_rows``:
``kvmosaic.quant.composite``). The kernels' layout of each kind is ``kvmosaic.quant.interleaved``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from kvmosaic.quant.composite import COLUMNS, CompositeWeight

BLOCK = 32  # weights per scale
SUPER = 256  # Q4_K super-block
Q = gguf.GGMLQuantizationType
SUB = 16  # Q6_K sub-block: weights per int8 scale
NATIVE_TYPES = frozenset((Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K))
REQUANTIZED_TYPES = frozenset((Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q5_K))  # held as Q8_0
QUANTIZATIONS = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q4_k": Q.Q4_K, "q6_k": Q.Q6_K}
SUPER_BLOCK_TYPES = (Q.Q4_K, Q.Q6_K)  # in_features must fill 256-weight super-blocks
PAIR_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)  # Q6_K: four 2-bit high parts per byte


def kind_of(scale: torch.Tensor, mins: torch.Tensor | None, super_scale: torch.Tensor | None) -> str:
    """The kind of a weight (row or interleaved layout) from the tensors it carries besides its codes."""
    if scale.dtype == torch.uint8:
        return "q4k"
    return "q6" if super_scale is not None else ("q8" if mins is None else "q4")


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A [N, K] linear weight in the q8, q4, q4k or q6 kind (see the module doc); ``source`` is its GGUF type."""

    codes: torch.Tensor  # int8 [N, K] (q8, q6) or uint8 [N, K / 2] (q4, q4k)
    scale: torch.Tensor  # [N, K / 32] float16 or float32; q6: int8 [N, K / 16]; q4k: uint8 sc [N, K / 32]
    min: torch.Tensor | None  # q4: like scale; q4k: uint8 m [N, K / 32]; q8, q6: None
    source: str
    super_scale: torch.Tensor | None = None  # q6: float32 d [N, K / 256]; q4k: float16 (d, -dmin) [N, K / 128]

    def __post_init__(self) -> None:
        n, k = self.shape
        packed = self.kind in ("q4", "q4k")
        expected = torch.uint8 if packed else torch.int8
        if self.codes.dtype != expected or tuple(self.codes.shape) != (n, k // 2 if packed else k):
            raise ValueError(f"{self.kind} codes must be {expected} [{n}, {k // 2 if packed else k}], got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")
        if self.kind == "q6":
            if self.scale.dtype != torch.int8 or self.min is not None or k % SUPER:
                raise ValueError("q6 weights have int8 sub-block scales, no mins and whole 256-weight super-blocks")
            if self.super_scale.dtype != torch.float32 or tuple(self.super_scale.shape) != (n, k // SUPER):
                raise ValueError(f"q6 super-block scales must be float32 [{n}, {k // SUPER}]")
            return
        if self.kind == "q4k":
            if self.min is None or self.min.dtype != torch.uint8 or self.min.shape != self.scale.shape or k % SUPER:
                raise ValueError("q4k weights have uint8 sub-block mins like their scales and whole 256-weight "
                                 "super-blocks")
            if self.super_scale.dtype != torch.float16 or tuple(self.super_scale.shape) != (n, 2 * k // SUPER):
                raise ValueError(f"q4k super-block (d, -dmin) pairs must be float16 [{n}, {2 * k // SUPER}]")
            return
        if self.scale.dtype not in (torch.float16, torch.float32):
            raise ValueError(f"scales must be float16 or float32, got {self.scale.dtype}")
        if self.min is not None and (self.min.shape != self.scale.shape or self.min.dtype != self.scale.dtype):
            raise ValueError("mins must match the scales in shape and dtype")

    @property
    def kind(self) -> str:
        return kind_of(self.scale, self.min, self.super_scale)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.scale.shape[1] * (SUB if self.kind == "q6" else BLOCK)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.min, self.super_scale) if t is not None)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows ``index`` (a row permutation, or a lookup)."""
        pick = lambda t: None if t is None else t[index].contiguous()
        return QuantizedWeight(pick(self.codes), pick(self.scale), pick(self.min), self.source,
                               pick(self.super_scale))


# ---------------------------------------------------------------------------------------- GGUF bytes
def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from byte pairs [..., 2] as float32 [..., 1]."""
    return raw.contiguous().view(torch.float16).float()


def _nibble_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] in Q4_0 order -> the 32 codes [..., 32] in weight order."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., 32] (0..15) -> uint8 [..., 16] in Q4_0 order."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def _q4k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 packed bytes [..., 12] -> the eight 6-bit scales and mins [..., 8]."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def from_gguf(raw: np.ndarray | torch.Tensor, qtype: Q) -> QuantizedWeight:
    """GGUF blocks, uint8 [N, row_bytes] as ``GGUFReader`` gives them, -> a QuantizedWeight."""
    data = torch.from_numpy(np.array(raw, dtype=np.uint8)) if isinstance(raw, np.ndarray) else raw.contiguous()
    n = data.shape[0]
    if qtype == Q.Q8_0:
        blocks = data.view(n, -1, 34)
        return QuantizedWeight(blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1),
                               blocks[..., :2].contiguous().view(torch.float16).reshape(n, -1), None, qtype.name)
    if qtype in (Q.Q4_0, Q.Q4_1):
        size = 18 if qtype == Q.Q4_0 else 20
        blocks = data.view(n, -1, size)
        d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, -1)
        m = -8 * d if qtype == Q.Q4_0 else blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
        return QuantizedWeight(blocks[..., size - 16:].reshape(n, -1).contiguous(), d, m, qtype.name)
    if qtype == Q.Q4_K:
        blocks = data.view(n, -1, 144)
        sc, mn = _q4k_scales(blocks[..., 4:16])
        d = blocks[..., 0:2].contiguous().view(torch.float16)  # [n, supers, 1]
        minus_dmin = -blocks[..., 2:4].contiguous().view(torch.float16)  # negating a float16 is exact
        qs = blocks[..., 16:].reshape(n, -1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low) and 2c + 1 (high)
        codes = torch.stack([qs & 0x0F, qs >> 4], dim=-2).reshape(n, -1, 32)  # [n, sub-blocks, 32]
        return QuantizedWeight(pack_nibbles(codes).reshape(n, -1), sc.reshape(n, -1).contiguous(),
                               mn.reshape(n, -1).contiguous(), qtype.name,
                               torch.cat([d, minus_dmin], dim=-1).reshape(n, -1).contiguous())
    if qtype == Q.Q6_K:  # per 128 weights r: ql byte r % 64 (nibble r // 64), qh byte r % 32 (bits 2 (r // 32))
        blocks = data.view(n, -1, 210)
        ql = blocks[..., :128].reshape(n, -1, 2, 64)
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32) >> PAIR_SHIFTS.view(4, 1)
        high = (qh & 0x03).reshape(n, -1, 2, 128)
        low = torch.cat([ql & 0x0F, ql >> 4], dim=-1)
        codes = (low | (high << 4)).view(torch.int8) - 32
        return QuantizedWeight(codes.reshape(n, -1).contiguous(), blocks[..., 192:208].reshape(n, -1).view(torch.int8),
                               None, qtype.name, _f16(blocks[..., 208:210]).reshape(n, -1))
    raise ValueError(f"GGUF type {qtype.name} has no native kernel format; supported: "
                     f"{', '.join(t.name for t in sorted(NATIVE_TYPES))}")


def codes_of(w: QuantizedWeight) -> torch.Tensor:
    """The integer codes [N, K] (int8 for q8 and q6, 0..15 as uint8 for q4 and q4k)."""
    if w.kind not in ("q4", "q4k"):
        return w.codes
    n = w.codes.shape[0]
    return _nibble_codes(w.codes.view(n, -1, 16)).reshape(n, -1)


def sub_block_scales(w: QuantizedWeight) -> torch.Tensor:
    """A q6 weight's float32 scale of each 16 weights [N, K / 16]: d * sc, exact (11 + 8 bits)."""
    return w.super_scale.repeat_interleave(SUPER // SUB, dim=1) * w.scale.float()


def q4k_scales(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A q4k weight's float32 scale d * sc and min (-dmin) * m of each 32 weights [N, K / 32], exact."""
    n = w.scale.shape[0]
    pairs = w.super_scale.float().view(n, -1, 1, 2)  # [N, supers, 1, (d, -dmin)]
    per_super = SUPER // BLOCK
    return ((pairs[..., 0] * w.scale.float().view(n, -1, per_super)).view(n, -1),
            (pairs[..., 1] * w.min.float().view(n, -1, per_super)).view(n, -1))


def as_q4(w: QuantizedWeight) -> QuantizedWeight:
    """A q4k weight as the q4 kind with float32 scales and mins: the same values, 6 bits a weight."""
    scale, low = q4k_scales(w)
    return QuantizedWeight(w.codes, scale, low, w.source)


def dequantize(w: QuantizedWeight | CompositeWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float [N, K]; in float32 equal bit for bit to ``gguf.quants.dequantize`` of the source blocks."""
    if isinstance(w, CompositeWeight):
        return torch.cat([dequantize(p, dtype) for p in w.parts])
    n, k = w.shape
    if w.kind == "q6":
        return (w.codes.float().view(n, -1, SUB) * sub_block_scales(w).unsqueeze(-1)).view(n, k).to(dtype)
    if w.kind == "q4k":
        w = as_q4(w)
    codes = codes_of(w).float().view(n, -1, BLOCK)
    values = codes * w.scale.float().unsqueeze(-1)
    if w.min is not None:
        values = values + w.min.float().unsqueeze(-1)
    return values.view(n, k).to(dtype)


# ----------------------------------------------------------------------- quantizing float weights
def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as ggml's roundf (and gguf.quants' np_roundf) does."""
    a = x.abs()
    floored = a.floor()
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _safe_inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _halves(x: torch.Tensor) -> torch.Tensor:
    """float32 [...] -> its float16 bytes [..., 2]."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def quantize_gguf(weight: torch.Tensor, qtype: Q) -> torch.Tensor:
    """float [N, K] -> GGUF blocks uint8 [N, row_bytes]; Q8_0, Q4_0 and Q4_1 byte-exact with
    ``gguf.quants.quantize`` (ggml's reference quantizers), Q4_K and Q6_K plain fits (no search)."""
    x = weight.detach().float().contiguous()
    n = x.shape[0]
    if qtype in SUPER_BLOCK_TYPES and x.shape[1] % SUPER:
        raise ValueError(f"{qtype.name} needs in_features divisible by {SUPER}, got {x.shape[1]}")
    if qtype == Q.Q4_K:
        return _quantize_q4k(x)
    if qtype == Q.Q6_K:
        return _quantize_q6k(x)
    blocks = x.view(n, -1, BLOCK)
    if qtype == Q.Q8_0:
        d = blocks.abs().amax(-1, keepdim=True) / 127
        qs = _roundf(blocks * _safe_inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_halves(d.squeeze(-1)), qs], -1).view(n, -1)
    if qtype == Q.Q4_0:
        peak = torch.gather(blocks, -1, blocks.abs().argmax(-1, keepdim=True))
        d = peak / -8
        qs = torch.trunc(blocks * _safe_inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
        return torch.cat([_halves(d.squeeze(-1)), pack_nibbles(qs)], -1).view(n, -1)
    if qtype == Q.Q4_1:
        hi, lo = blocks.amax(-1, keepdim=True), blocks.amin(-1, keepdim=True)
        d = (hi - lo) / 15
        qs = torch.trunc((blocks - lo) * _safe_inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
        return torch.cat([_halves(d.squeeze(-1)), _halves(lo.squeeze(-1)), pack_nibbles(qs)], -1).view(n, -1)
    raise ValueError(f"cannot quantize to GGUF type {qtype.name}")


def _quantize_q4k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    sub = x.view(n, -1, 8, BLOCK)  # [n, supers, 8, 32]
    low = sub.amin(-1).clamp(max=0)
    scale = (sub.amax(-1) - low) / 15
    d = (scale.amax(-1) / 63).to(torch.float16).float()  # [n, supers]
    dmin = ((-low).amax(-1) / 63).to(torch.float16).float()
    sc = _roundf(scale * _safe_inverse(d).unsqueeze(-1)).clamp(0, 63)
    mn = _roundf(-low * _safe_inverse(dmin).unsqueeze(-1)).clamp(0, 63)
    eff_scale = (d.unsqueeze(-1) * sc).unsqueeze(-1)
    eff_min = (dmin.unsqueeze(-1) * mn).unsqueeze(-1)
    qs = _roundf((sub + eff_min) * _safe_inverse(eff_scale)).clamp(0, 15).to(torch.uint8)
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    packed_scales = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                               (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], -1)
    pairs = qs.view(n, -1, 4, 2, BLOCK)  # sub-blocks 2c and 2c + 1 share chunk c's bytes
    nibbles = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, -1, 128)
    return torch.cat([_halves(d), _halves(dmin), packed_scales, nibbles], -1).view(n, -1)


def _quantize_q6k(x: torch.Tensor) -> torch.Tensor:
    """Each 16 weights' largest magnitude lands on code -32 (as Q4_0's on -8); the sub-block scales are
    int8 steps of d = the super-block's largest scale / 127."""
    n = x.shape[0]
    sub = x.view(n, -1, SUPER // SUB, SUB)  # [n, supers, 16, 16]
    peak = torch.gather(sub, -1, sub.abs().argmax(-1, keepdim=True)).squeeze(-1)
    scale = peak / -32
    d = (scale.abs().amax(-1) / 127).to(torch.float16).float()  # [n, supers]
    sc = _roundf(scale * _safe_inverse(d).unsqueeze(-1)).clamp(-128, 127)
    step = (d.unsqueeze(-1) * sc).unsqueeze(-1)
    u = (_roundf(sub * _safe_inverse(step)).clamp(-32, 31) + 32).to(torch.uint8).view(n, -1, 2, 128)
    ql = u[..., :64] & 0x0F | ((u[..., 64:] & 0x0F) << 4)  # [n, supers, 2, 64]
    hi = (u >> 4).view(n, -1, 2, 4, 32) << PAIR_SHIFTS.view(4, 1)
    qh = hi[..., 0, :] | hi[..., 1, :] | hi[..., 2, :] | hi[..., 3, :]  # [n, supers, 2, 32]
    sc_bytes = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc_bytes, _halves(d)], -1).view(n, -1)


def quantize(weight: torch.Tensor, quantization: str) -> QuantizedWeight:
    """A float weight quantized at load: ``quantization`` is one of QUANTIZATIONS. Q4_K and Q6_K need
    in_features % 256 == 0; narrower weights take Q4_1 and Q8_0, as llama.cpp's quantizer falls back
    for rows that do not fill a super-block."""
    qtype = QUANTIZATIONS[quantization]
    if qtype in SUPER_BLOCK_TYPES and weight.shape[1] % SUPER:
        qtype = Q.Q4_1 if qtype == Q.Q4_K else Q.Q8_0
    return from_gguf(quantize_gguf(weight, qtype), qtype)


def requantize(weight: torch.Tensor, source: str) -> QuantizedWeight:
    """Float32 values of a weight stored as ``source`` (a GGUF type of REQUANTIZED_TYPES, say), held as Q8_0."""
    return dataclasses.replace(quantize(weight, "q8_0"), source=f"{source} as Q8_0")


def _widened(w: QuantizedWeight) -> QuantizedWeight:
    """The same weight with float32 scales and mins (float16 ones widen exactly; q4k becomes q4)."""
    if w.kind == "q4k":
        return as_q4(w)
    wide = lambda t: None if t is None else t.float()
    return QuantizedWeight(w.codes, wide(w.scale), wide(w.min), w.source)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight | CompositeWeight:
    """Weights stacked along out_features (q/k/v, gate/up). Scales of different dtypes widen to
    float32 (exact), q4k next to q4 as q4 (``as_q4``, exact). Weights of other different kinds (a Q4_K
    file's Q6_K v projection next to its Q4_K q and k) make a ``CompositeWeight`` of runs of one kind,
    each held as it is, when every run fills whole 16-row groups; otherwise they meet as Q8_0 (the
    others requantized)."""
    if {w.kind for w in weights} == {"q4", "q4k"}:
        weights = [_widened(w) for w in weights]
    first = weights[0]
    runs = [list(run) for _, run in itertools.groupby(weights, key=lambda w: w.kind)]
    if len(runs) > 1 and all(sum(w.shape[0] for w in run) % COLUMNS == 0 for run in runs):
        return CompositeWeight(tuple(run[0] if len(run) == 1 else concat_rows(run) for run in runs))
    if any(w.kind != first.kind for w in weights):
        weights = [w if w.kind == "q8" else requantize(dequantize(w), w.source) for w in weights]
        first = weights[0]
    if any(w.scale.dtype != first.scale.dtype for w in weights):
        weights = [_widened(w) for w in weights]
    cat = lambda ts: torch.cat(ts) if ts[0] is not None else None
    sources = "+".join(dict.fromkeys(w.source for w in weights))
    return QuantizedWeight(cat([w.codes for w in weights]), cat([w.scale for w in weights]),
                           cat([w.min for w in weights]), sources, cat([w.super_scale for w in weights]))
