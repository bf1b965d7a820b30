"""Fill-in-the-middle prompts (``suffix`` on completions) for models trained with FIM tokens."""

from __future__ import annotations

from kvmosaic.model.tokenizer import Tokenizer

# (prefix, suffix, middle) token spellings of the common FIM dialects: StarCoder / SantaCoder,
# Qwen2.5-Coder, and CodeLlama.
_DIALECTS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<PRE>", "<SUF>", "<MID>"),
)


def fill_in_the_middle_prompt(tokenizer: Tokenizer, prefix: str, suffix: str) -> str:
    """The prompt that asks the model for the text between ``prefix`` and ``suffix`` (PSM order);
    ValueError when the model has no FIM tokens."""
    for pre, suf, mid in _DIALECTS:
        if all(tokenizer.token_to_id(t) is not None for t in (pre, suf, mid)):
            return f"{pre}{prefix}{suf}{suffix}{mid}"
    raise ValueError("suffix is not supported: this model has no fill-in-the-middle tokens")
