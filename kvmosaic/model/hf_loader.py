"""Hugging Face checkpoint directories: config.json + safetensors, read and written."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvmosaic.config import ModelConfig
from kvmosaic.model.tokenizer import Tokenizer

# model_type -> (our architecture, HF class name)
HF_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    config = hf_model_config(json.loads(config_file.read_text(encoding="utf-8")))
    weights = {}
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 -- safe_open handles are not iterable
                if _is_model_weight(name, config):
                    weights[name] = shard.get_tensor(name).to(dtype)
    return config, weights, Tokenizer.from_hf_dir(path)


def hf_model_config(cfg: dict) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        names = cfg.get("architectures") or []
        raise ValueError(
            f"unsupported architecture model_type={model_type!r} {names} in config.json; "
            f"supported: {', '.join(HF_ARCHITECTURES)}"
        )
    _reject_unsupported_options(cfg)
    theta, rope_scaling = _rope_params(cfg)
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        architecture=HF_ARCHITECTURES[model_type][0],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        # Qwen2 always has q/k/v biases; its config has no flag for them.
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=() if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos)),
        name=cfg.get("_name_or_path", ""),
    )


def _reject_unsupported_options(cfg: dict) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if cfg.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")


def _rope_params(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers-4 keys or transformers-5 ``rope_parameters``."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def _is_model_weight(name: str, config: ModelConfig) -> bool:
    if name == "lm_head.weight":
        return not config.tie_word_embeddings  # some tied checkpoints still store a copy
    return name.startswith("model.") and "rotary_emb" not in name


def write_hf_dir(config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write a directory transformers' AutoModelForCausalLM / AutoTokenizer (and vLLM) can load."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = weights["model.embed_tokens.weight"].dtype
    tensors = {name: w.contiguous() for name, w in weights.items()
               if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", hf_config_dict(config, dtype))
    write_tokenizer_files(tokenizer, config, out_dir)


def write_tokenizer_files(tokenizer: Tokenizer, config: ModelConfig, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json of an HF directory."""
    (out_dir / "tokenizer.json").write_text(tokenizer.to_json(), encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tokenizer, config))
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _one_or_list(config.eos_token_ids),
    })


def hf_config_dict(config: ModelConfig, dtype: torch.dtype) -> dict:
    model_type = config.architecture
    rope_parameters = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    return {
        "_name_or_path": config.name,
        "architectures": [HF_ARCHITECTURES[model_type][1]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _one_or_list(config.eos_token_ids),
        # Both spellings: transformers 5 reads rope_parameters, older readers (vLLM, transformers 4) the rest.
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "rope_parameters": rope_parameters,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _tokenizer_config(tokenizer: Tokenizer, config: ModelConfig) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": tokenizer.chat_template,
    }


def _one_or_list(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
