"""Model shapes of what people run on CPUs, from the real models' Hugging Face config.json files.

The benchmark builds each with random weights (speed does not depend on their values), so no hub is
needed. Numbers are those of the published config.json of each model (the base model's repository,
revision current in 2025); the files were read through public copies of them in the code corpus
(e.g. configuration dictionaries of Llama-3.2-1B/3B, Qwen2.5-0.5B and SmolLM2-1.7B-Instruct that
reproduce the config.json field by field). Standard library only: runners in other venvs import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Llama 3.x rope scaling (every Llama 3.2 config.json carries exactly this block).
LLAMA3_ROPE_SCALING = (("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                       ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The architecture fields of one model's config.json (model_type ``architecture``)."""

    name: str  # the published model it copies
    architecture: str  # config.json model_type: "llama" or "qwen2" (what the loader reads)
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    tie_word_embeddings: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    extra: tuple[tuple[str, object], ...] = field(default=())  # other config.json keys, copied as they are

    def __post_init__(self) -> None:
        if self.architecture not in HF_CLASSES:
            raise ValueError(f"{self.name}: architecture {self.architecture!r} is not one of {sorted(HF_CLASSES)}")
        dims = (self.hidden_size, self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads,
                self.head_dim, self.intermediate_size, self.vocab_size, self.max_position_embeddings)
        if min(dims) < 1:
            raise ValueError(f"{self.name}: every dimension must be positive, got {dims}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.name}: {self.num_attention_heads} heads are not a multiple of "
                             f"{self.num_key_value_heads} KV heads")

    @property
    def attention_bias(self) -> bool:
        return self.architecture == "qwen2"  # Qwen2 always has q/k/v biases

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint under its HF name, (out_features, in_features) for matrices."""
        d, f = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, d),
                                              "model.norm.weight": (d,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, d)
        for i in range(self.num_hidden_layers):
            layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                     "self_attn.q_proj.weight": (self.q_dim, d), "self_attn.k_proj.weight": (self.kv_dim, d),
                     "self_attn.v_proj.weight": (self.kv_dim, d), "self_attn.o_proj.weight": (d, self.q_dim),
                     "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
            if self.attention_bias:
                layer.update({"self_attn.q_proj.bias": (self.q_dim,), "self_attn.k_proj.bias": (self.kv_dim,),
                              "self_attn.v_proj.bias": (self.kv_dim,)})
            shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
        return shapes

    def num_params(self) -> int:
        total = 0
        for shape in self.tensor_shapes().values():
            size = 1
            for dim in shape:
                size *= dim
            total += size
        return total

    def kv_bytes_per_token(self, element_bytes: float) -> float:
        """K and V of one token over every layer."""
        return 2 * self.num_hidden_layers * self.kv_dim * element_bytes

    def hf_config(self, bos_token_id: int | None, eos_token_id: int | list[int] | None) -> dict:
        """config.json: the real model's architecture fields; the special token ids are the tokenizer's
        that the directory ships (the embedded default model's), not the original model's."""
        config = {
            "architectures": [HF_CLASSES[self.architecture]], "model_type": self.architecture,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "initializer_range": 0.02,
            "attention_dropout": 0.0, "use_cache": True, "torch_dtype": "bfloat16",
            "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        }
        if self.architecture == "llama":
            config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
        config.update(dict(self.extra))
        return config


SHAPES: dict[str, ModelShape] = {
    # Qwen/Qwen2.5-0.5B config.json (Qwen2ForCausalLM): GQA 14/2, tied, q/k/v biases.
    "qwen2.5-0.5b": ModelShape(
        "Qwen2.5-0.5B", "qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, head_dim=64, intermediate_size=4864, vocab_size=151936, rope_theta=1000000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768,
        extra=(("use_sliding_window", False), ("sliding_window", 32768), ("max_window_layers", 24))),
    # meta-llama/Llama-3.2-1B config.json: GQA 32/8, tied, llama3 rope scaling.
    "llama-3.2-1b": ModelShape(
        "Llama-3.2-1B", "llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling=LLAMA3_ROPE_SCALING),
    # HuggingFaceTB/SmolLM2-1.7B config.json (LlamaForCausalLM): full multi-head attention, tied.
    "smollm2-1.7b": ModelShape(
        "SmolLM2-1.7B", "llama", hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, head_dim=64, intermediate_size=8192, vocab_size=49152, rope_theta=130000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192),
    # meta-llama/Llama-3.2-3B config.json: GQA 24/8 with 128-wide heads, tied, llama3 rope scaling.
    "llama-3.2-3b": ModelShape(
        "Llama-3.2-3B", "llama", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling=LLAMA3_ROPE_SCALING),
}
