"""Where the files of a real-size model shape live, which formats it gets and how much disk they take.

    .peers/models/<shape>/hf/                     config.json, sharded bf16 safetensors, tokenizer (vLLM, HF)
    .peers/models/<shape>/<shape>-<format>.gguf   llama.cpp's converter (bf16, f32) and quantizer (q8_0, q4_k_m)

Standard library only (peers.py and make_models.py import it; nothing here reads a model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peer_runners.shapes import SHAPES, ModelShape

MODELS = Path(__file__).resolve().parents[2] / ".peers" / "models"
DEFAULT_MODEL = "smollm2-135m"  # the embedded default model (peer_runners/models.py), not a shape here
# GGUF formats: converter outputs, then quantizer outputs made from the bf16 file.
CONVERTED = ("bf16", "f32")
QUANTIZED = ("q8_0", "q4_k_m")
FORMATS = CONVERTED + QUANTIZED
DEFAULT_FORMATS = ("bf16", "q8_0", "q4_k_m")
F32_MAX_PARAMS = 1.3e9  # f32 files only for shapes up to the 1B class (a 3B f32 file is 13 GB)
# The benchmark's dtype names -> GGUF format of the file kvmosaic and llama.cpp read.
DTYPE_FORMATS = {"bfloat16": "bf16", "float32": "f32", "q8_0": "q8_0", "q4_k_m": "q4_k_m"}
# Bytes per weight, for the disk plan only (q4_k_m: llama.cpp's mix, Q4_K with Q6_K for some tensors).
_BYTES_PER_WEIGHT = {"bf16": 2.0, "f32": 4.0, "q8_0": 34 / 32, "q4_k_m": 0.61}


def check_shape(key: str) -> ModelShape:
    if key not in SHAPES:
        raise ValueError(f"unknown model shape {key!r}; choose from {', '.join(SHAPES)}")
    return SHAPES[key]


def check_formats(shape: ModelShape, formats: list[str]) -> list[str]:
    """``formats`` in build order (converted before quantized), each valid for ``shape``."""
    if unknown := set(formats) - set(FORMATS):
        raise ValueError(f"unknown formats {sorted(unknown)}; choose from {', '.join(FORMATS)}")
    if "f32" in formats and shape.num_params() > F32_MAX_PARAMS:
        raise ValueError(f"{shape.name} has {shape.num_params() / 1e9:.2f}B parameters: no f32 file above "
                         f"{F32_MAX_PARAMS / 1e9:.1f}B (disk and RAM)")
    return [f for f in FORMATS if f in formats]


@dataclass(frozen=True, slots=True)
class ShapeFiles:
    key: str

    @property
    def shape(self) -> ModelShape:
        return check_shape(self.key)

    @property
    def root(self) -> Path:
        return MODELS / self.key

    @property
    def hf_dir(self) -> Path:
        return self.root / "hf"

    def gguf(self, fmt: str) -> Path:
        if fmt not in FORMATS:
            raise ValueError(f"unknown GGUF format {fmt!r}; choose from {', '.join(FORMATS)}")
        return self.root / f"{self.key}-{fmt}.gguf"

    def gguf_for_dtype(self, dtype: str) -> Path:
        if dtype not in DTYPE_FORMATS:
            raise ValueError(f"no GGUF file for dtype {dtype!r}; choose from {', '.join(DTYPE_FORMATS)}")
        return self.gguf(DTYPE_FORMATS[dtype])


def estimated_bytes(shape: ModelShape, fmt: str) -> float:
    """Approximate size of one file (``fmt`` a GGUF format, or "hf" for the bf16 HF directory)."""
    per_weight = _BYTES_PER_WEIGHT["bf16" if fmt == "hf" else fmt]
    return shape.num_params() * per_weight


def disk_plan(shape: ModelShape, formats: list[str]) -> dict[str, float]:
    """Estimated bytes of every file a build makes: the HF directory, bf16 (the quantizer's source) and ``formats``."""
    files = ["hf", "bf16", *(f for f in formats if f != "bf16")]
    return {f: estimated_bytes(shape, f) for f in files}
