"""Oaken's offline part: per-layer K/V thresholds and K centers, the calibration file, and its validation.

File format (JSON)::

    {"format": "kvmosaic-kv-thresholds", "version": 3,
     "model": {"name", "architecture", "num_hidden_layers", "num_key_value_heads", "head_dim",
               "hidden_size", "vocab_size", "fingerprint"},
     "outer_ratio": 0.04, "inner_ratio": 0.06, "sparse_capacity": 7, "num_prompts": 100,
     "calibration_text": "...", "overflow_rate": 0.004,
     "key_rotation": {"signs": [head_dim of +-1], "exponent": 0.5},  (optional)
     "layers": [{"k": [outer_lo, inner_lo, inner_hi, outer_hi], "v": [...],
                 "k_center": [[head_dim floats] per KV head],
                 "k_scale": [[head_dim floats] per KV head]}, ...]}  (k_scale: with key_rotation)

``k_center`` is the calibration mean of each layer's keys (after rotary), per KV head and channel.
Keys are quantized with it subtracted and it is never added back: a constant vector c added to
every key changes every score of a query q by the same q . c, which softmax cancels, so attention
over centered keys is the same function. Centering takes the large common offset of a few key
channels out of the range the per-token scales must cover; the thresholds are those of the centered
keys. With ``key_rotation`` keys are also divided by ``k_scale`` and rotated, queries multiplied and
rotated alike (``kvmosaic.quant.rotation``), and the K thresholds are those of the rotated keys.
Version 1 files (no centers) and 2 (no rotation) still load.

``fingerprint`` is the mean absolute value of layer 0's k_proj weight: two checkpoints of the same
shape but different weights (base vs instruct) are told apart, while a float32 and a bfloat16
load of one checkpoint agree to far better than ``FINGERPRINT_RTOL``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvmosaic.config import ModelConfig
from kvmosaic.quant.rotation import KeyRotation
from kvmosaic.quant.weights import dequantize

FORMAT_NAME = "kvmosaic-kv-thresholds"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
FINGERPRINT_RTOL = 1e-3
DATA_DIR = Path(__file__).parent / "data"
DEFAULT_MODEL_THRESHOLDS = DATA_DIR / "smollm2-135m-instruct.kv_thresholds.json"


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    name: str
    architecture: str
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    fingerprint: float

    @classmethod
    def of(cls, config: ModelConfig, weights: dict[str, torch.Tensor]) -> ModelIdentity:
        k_proj = weights["model.layers.0.self_attn.k_proj.weight"]
        if not isinstance(k_proj, torch.Tensor):  # a quantized weight: its float values
            k_proj = dequantize(k_proj)
        return cls(config.name, config.architecture, config.num_hidden_layers, config.num_key_value_heads,
                   config.head_dim, config.hidden_size, config.vocab_size, float(k_proj.float().abs().mean()))

    def check_matches(self, model: ModelIdentity) -> None:
        """Raise ValueError naming the first difference between the calibrated model and ``model``."""
        for name in ("architecture", "num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size",
                     "vocab_size"):
            ours, theirs = getattr(self, name), getattr(model, name)
            if ours != theirs:
                raise ValueError(f"KV thresholds were calibrated for {self.name!r} with {name}={ours}, "
                                 f"but this model ({model.name!r}) has {name}={theirs}; run `kvmosaic calibrate-kv`")
        if abs(self.fingerprint - model.fingerprint) > FINGERPRINT_RTOL * abs(self.fingerprint):
            raise ValueError(f"KV thresholds were calibrated for other weights ({self.name!r}, fingerprint "
                             f"{self.fingerprint:.6g}) than this model's ({model.name!r}, {model.fingerprint:.6g}); "
                             "run `kvmosaic calibrate-kv`")


@dataclass(slots=True)
class KVThresholds:
    model: ModelIdentity
    layers: torch.Tensor  # [L, 2 (K, V), 4]: outer_lo, inner_lo, inner_hi, outer_hi
    k_center: torch.Tensor | None = None  # [L, Hk, head_dim]: subtracted from keys before quantization
    outer_ratio: float = 0.04
    inner_ratio: float = 0.06
    sparse_capacity: int = 7
    num_prompts: int = 0
    calibration_text: str = ""
    overflow_rate: float = 0.0
    extra: dict = field(default_factory=dict)
    rotation_signs: torch.Tensor | None = None  # [head_dim] +-1: keys rotated (kvmosaic.quant.rotation)
    k_scale: torch.Tensor | None = None  # [L, Hk, head_dim]: with rotation_signs
    rotation_exponent: float = 0.0

    def __post_init__(self) -> None:
        self.layers = torch.as_tensor(self.layers, dtype=torch.float32)
        expected = (self.model.num_hidden_layers, 2, 4)
        if tuple(self.layers.shape) != expected:
            raise ValueError(f"thresholds have shape {tuple(self.layers.shape)}, expected {expected} "
                             f"for a model with {self.model.num_hidden_layers} layers")
        if not torch.isfinite(self.layers).all():
            raise ValueError("thresholds must be finite")
        centers = (self.model.num_hidden_layers, self.model.num_key_value_heads, self.model.head_dim)
        self.k_center = torch.zeros(centers) if self.k_center is None else torch.as_tensor(
            self.k_center, dtype=torch.float32)
        if tuple(self.k_center.shape) != centers:
            raise ValueError(f"k_center has shape {tuple(self.k_center.shape)}, expected {centers}")
        if not torch.isfinite(self.k_center).all():
            raise ValueError("k_center must be finite")
        if (self.rotation_signs is None) != (self.k_scale is None):
            raise ValueError("a key rotation needs both its signs and the per-layer k_scale")
        if self.rotation_signs is not None:
            self.rotation_signs = torch.as_tensor(self.rotation_signs, dtype=torch.float32)
            self.k_scale = torch.as_tensor(self.k_scale, dtype=torch.float32)
            d = self.model.head_dim
            if tuple(self.rotation_signs.shape) != (d,) or not (self.rotation_signs.abs() == 1).all():
                raise ValueError(f"key_rotation signs must be {d} values of +1 or -1")
            if d & (d - 1):
                raise ValueError(f"a key rotation needs a power-of-two head_dim, not {d}")
            if tuple(self.k_scale.shape) != centers:
                raise ValueError(f"k_scale has shape {tuple(self.k_scale.shape)}, expected {centers}")
            if not (torch.isfinite(self.k_scale).all() and (self.k_scale > 0).all()):
                raise ValueError("k_scale must be finite and positive")
        o_lo, i_lo, i_hi, o_hi = self.layers.unbind(-1)
        if not ((o_lo <= i_lo) & (i_lo <= 0) & (i_hi >= 0) & (i_hi <= o_hi)).all():
            raise ValueError("every threshold row must satisfy outer_lo <= inner_lo <= 0 <= inner_hi <= outer_hi")
        if not (0 <= self.outer_ratio < 1 and 0 <= self.inner_ratio < 1 and self.outer_ratio + self.inner_ratio < 1):
            raise ValueError("outer_ratio and inner_ratio must be in [0, 1) and sum below 1")
        if not 0 <= self.sparse_capacity <= self.model.head_dim:
            raise ValueError(f"sparse_capacity must be in [0, {self.model.head_dim}]")

    def key_rotation(self, layer: int) -> KeyRotation | None:
        """Layer ``layer``'s rotation of keys and queries, or None when keys are stored unrotated."""
        if self.rotation_signs is None:
            return None
        return KeyRotation.of(self.rotation_signs, self.k_scale[layer], self.k_center[layer])

    def to_json(self) -> dict:
        layers = [{"k": kv[0].tolist(), "v": kv[1].tolist(), "k_center": center.tolist()}
                  for kv, center in zip(self.layers, self.k_center, strict=True)]
        rotation = {}
        if self.rotation_signs is not None:
            rotation = {"key_rotation": {"signs": [int(x) for x in self.rotation_signs.tolist()],
                                         "exponent": self.rotation_exponent}}
            for row, scale in zip(layers, self.k_scale, strict=True):
                row["k_scale"] = scale.tolist()
        return {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "model": asdict(self.model),
            "outer_ratio": self.outer_ratio, "inner_ratio": self.inner_ratio,
            "sparse_capacity": self.sparse_capacity, "num_prompts": self.num_prompts,
            "calibration_text": self.calibration_text, "overflow_rate": self.overflow_rate, **self.extra,
            **rotation, "layers": layers,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def parse(data: dict) -> KVThresholds:
    """Build thresholds from a decoded file; ValueError with the reason when it is not one."""
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise ValueError(f"not a kvmosaic KV thresholds file (missing \"format\": \"{FORMAT_NAME}\")")
    if data.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"unsupported KV thresholds version {data.get('version')!r}; expected {FORMAT_VERSION}")
    try:
        model = ModelIdentity(**data["model"])
        layers = [[row["k"], row["v"]] for row in data["layers"]]
        centers = [row["k_center"] for row in data["layers"]] if data["version"] >= 2 else None
        rotation = data.get("key_rotation") if data["version"] >= 3 else None
        scales = None if rotation is None else [row["k_scale"] for row in data["layers"]]
        known = {"format", "version", "model", "layers", "outer_ratio", "inner_ratio", "sparse_capacity",
                 "num_prompts", "calibration_text", "overflow_rate", "key_rotation"}
        return KVThresholds(
            model=model, layers=torch.tensor(layers, dtype=torch.float32),
            k_center=None if centers is None else torch.tensor(centers, dtype=torch.float32),
            rotation_signs=None if rotation is None else torch.tensor(rotation["signs"], dtype=torch.float32),
            k_scale=None if scales is None else torch.tensor(scales, dtype=torch.float32),
            rotation_exponent=0.0 if rotation is None else float(rotation["exponent"]),
            outer_ratio=float(data["outer_ratio"]), inner_ratio=float(data["inner_ratio"]),
            sparse_capacity=int(data["sparse_capacity"]), num_prompts=int(data.get("num_prompts", 0)),
            calibration_text=str(data.get("calibration_text", "")),
            overflow_rate=float(data.get("overflow_rate", 0.0)),
            extra={k: v for k, v in data.items() if k not in known},
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed KV thresholds file: missing or bad field {exc}") from exc


def load(path: str | Path, model: ModelIdentity | None = None) -> KVThresholds:
    """Read a thresholds file; when ``model`` is given, check it was calibrated for that model."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"KV thresholds file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    thresholds = parse(data)
    if model is not None:
        thresholds.model.check_matches(model)
    return thresholds


def for_model(path: str | Path | None, model: ModelIdentity, is_default_model: bool) -> KVThresholds:
    """The thresholds an engine uses: ``path``, or the file shipped for the embedded default model."""
    if path is None:
        if not is_default_model:
            raise ValueError("kv_cache_dtype='oaken' needs thresholds calibrated for this model: run "
                             "`kvmosaic calibrate-kv --model M --out FILE` and pass kv_thresholds=FILE")
        path = DEFAULT_MODEL_THRESHOLDS
    return load(path, model)
