"""Model and hardware presets for the planner, and reading a model shape from an HF config.json."""

from __future__ import annotations

import json
from pathlib import Path

from kvmosaic.planner.roofline import HardwareSpec, ModelSpec

GiB = 1024**3

MODEL_PRESETS: dict[str, ModelSpec] = {
    # The embedded SmolLM2-135M-Instruct.
    "default": ModelSpec("SmolLM2-135M", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                         num_kv_heads=3, head_dim=64, vocab_size=49152, tie_embeddings=True),
    "llama2-13b": ModelSpec("LLaMA-2-13B", num_layers=40, hidden_size=5120, intermediate_size=13824,
                            num_heads=40, num_kv_heads=40, head_dim=128, vocab_size=32000),
    "llama3-8b": ModelSpec("LLaMA-3-8B", num_layers=32, hidden_size=4096, intermediate_size=14336,
                           num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256),
    # The worked-problems model of the book's inference chapter (shared input/output embeddings).
    "problem": ModelSpec("problem model", num_layers=64, hidden_size=4096, intermediate_size=16384,
                         num_heads=32, num_kv_heads=8, head_dim=256, vocab_size=32128, tie_embeddings=True),
}

# The book's figures. v5e bandwidth is 8.2e11 B/s: its LLaMA-2-13B tables (and B_crit = 240) use that,
# although its TPU chapter lists 8.1e11. Capacities are binary: 8 v5e chips "give us 128GiB".
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "tpu-v5e": HardwareSpec("TPU v5e", hbm_bandwidth=8.2e11, hbm_bytes=16 * GiB,
                            flops_bf16=1.97e14, flops_int8=3.94e14),
    # GPU chapter's table for bf16/int8; fp32 is NVIDIA's datasheet figure for the CUDA cores.
    "h100": HardwareSpec("H100", hbm_bandwidth=3.4e12, hbm_bytes=80 * GiB,
                         flops_bf16=9.9e14, flops_int8=2.0e15, flops_fp32=6.7e13),
    "a100-80gb": HardwareSpec("A100-80GB", hbm_bandwidth=2.0e12, hbm_bytes=80 * GiB,
                              flops_bf16=3.1e14, flops_int8=6.2e14, flops_fp32=1.95e13),
}


def model_from_hf_config(cfg: dict, name: str = "") -> ModelSpec:
    """The shape fields of a Hugging Face config.json, parsed by the model loader's own reader."""
    from kvmosaic.model.hf_loader import hf_model_config  # lazy: keeps the planner free of torch at import

    mc = hf_model_config(cfg)
    return ModelSpec(
        name=name or mc.name or cfg.get("model_type", "model"),
        num_layers=mc.num_hidden_layers,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_heads=mc.num_attention_heads,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        vocab_size=mc.vocab_size,
        tie_embeddings=mc.tie_word_embeddings,
        attention_bias=mc.attention_bias,
    )


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name, a config.json file, or a directory holding one."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{name_or_path!r} is neither a model preset ({', '.join(MODEL_PRESETS)}) "
                                "nor a config.json file")
    try:
        return model_from_hf_config(json.loads(path.read_text(encoding="utf-8")), name=path.parent.name)
    except KeyError as exc:
        raise ValueError(f"{path} lacks the field {exc.args[0]!r}") from exc


def resolve_hardware(name: str) -> HardwareSpec:
    if name not in HARDWARE_PRESETS:
        raise ValueError(f"unknown hardware {name!r}; use one of {', '.join(HARDWARE_PRESETS)} or --probe")
    return HARDWARE_PRESETS[name]
