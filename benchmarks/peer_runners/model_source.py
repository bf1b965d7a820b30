"""Which file each engine reads for a dtype, for the default model or a real-size shape (``--model``).

The default model (smollm2-135m): kvmosaic, HF and vLLM read a float32 HF directory exported from the
embedded GGUF, llama.cpp the GGUF files made from it, kvmosaic quantizes q8_0 at load and runs the
shipped Q4_1 file (peer_runners/models.py). A shape (benchmarks/make_models.py): kvmosaic and llama.cpp
read the same GGUF for every dtype (q4_k_m, q8_0, bf16, f32), vLLM and HF the bf16 HF directory.
Runs in the main venv.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peer_runners.common import WEIGHT_FORMATS
from peer_runners.models import CT2_DIR, HF_DIR, gguf_for, prepare_models
from peer_runners.shape_files import DEFAULT_MODEL, DTYPE_FORMATS, ShapeFiles
from peer_runners.shapes import SHAPES

GGUF_ENGINES = ("kvmosaic", "llamacpp")


@dataclass(frozen=True, slots=True)
class DefaultModel:
    key: str = DEFAULT_MODEL
    label: str = "SmolLM2-135M-Instruct"
    default_dtypes: tuple[str, ...] = ("float32", "bfloat16")

    def supports(self, engine: str, dtype: str) -> bool:
        return dtype not in WEIGHT_FORMATS or engine in GGUF_ENGINES

    def path(self, engine: str, dtype: str) -> Path:
        if engine == "llamacpp" or dtype in ("q4_1", "q4_k_m"):
            return gguf_for(dtype)
        return CT2_DIR if engine == "ct2" else HF_DIR  # kvmosaic quantizes q8_0 at load

    def startup_path(self, dtype: str) -> Path | None:
        """None: the embedded default model (a Q4_1 file), whatever the dtype."""
        return None

    def startup_dtypes(self, dtypes: list[str]) -> list[str]:
        return [d for d in dtypes if d not in WEIGHT_FORMATS or d == "q4_1"]

    def prepare(self, engines: list, dtypes: list[str]) -> dict[str, str]:
        return prepare_models(engines, dtypes)

    def planner_model(self):
        from kvmosaic.planner import MODEL_PRESETS

        return MODEL_PRESETS["default"]


@dataclass(frozen=True, slots=True)
class ShapeModel:
    files: ShapeFiles
    default_dtypes: tuple[str, ...] = ("q4_k_m", "q8_0", "bfloat16")

    @property
    def key(self) -> str:
        return self.files.key

    @property
    def label(self) -> str:
        return f"{self.files.shape.name} shape (random weights)"

    def supports(self, engine: str, dtype: str) -> bool:
        if engine in GGUF_ENGINES:
            return dtype in DTYPE_FORMATS
        return engine in ("vllm", "hf") and dtype in ("bfloat16", "float32")  # no CTranslate2 model is made

    def path(self, engine: str, dtype: str) -> Path:
        return self.files.gguf_for_dtype(dtype) if engine in GGUF_ENGINES else self.files.hf_dir

    def startup_path(self, dtype: str) -> Path:
        return self.files.gguf_for_dtype(dtype)

    def startup_dtypes(self, dtypes: list[str]) -> list[str]:
        return [d for d in dtypes if d in DTYPE_FORMATS]

    def prepare(self, engines: list, dtypes: list[str]) -> dict[str, str]:
        """Nothing is made here (make_models.py does it, once): an engine whose files are missing is skipped."""
        skipped = {}
        for engine in engines:
            missing = sorted({str(p) for d in dtypes if self.supports(engine.key, d)
                              for p in [self.path(engine.key, d)] if not p.exists()})
            if missing:
                formats = ",".join(sorted({DTYPE_FORMATS[d] for d in dtypes if d in DTYPE_FORMATS}))
                skipped[engine.key] = (f"missing {', '.join(missing)} (python benchmarks/make_models.py "
                                       f"--model {self.key} --formats {formats})")
        return skipped

    def planner_model(self):
        from kvmosaic.planner import ModelSpec

        s = self.files.shape
        return ModelSpec(s.name, num_layers=s.num_hidden_layers, hidden_size=s.hidden_size,
                         intermediate_size=s.intermediate_size, num_heads=s.num_attention_heads,
                         num_kv_heads=s.num_key_value_heads, head_dim=s.head_dim, vocab_size=s.vocab_size,
                         tie_embeddings=s.tie_word_embeddings, attention_bias=s.attention_bias)


MODEL_CHOICES = (DEFAULT_MODEL, *SHAPES)


def model_source(key: str) -> DefaultModel | ShapeModel:
    if key == DEFAULT_MODEL:
        return DefaultModel()
    if key not in SHAPES:
        raise ValueError(f"unknown model {key!r}; choose from {', '.join(MODEL_CHOICES)}")
    return ShapeModel(ShapeFiles(key))
