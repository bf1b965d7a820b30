"""Rebuild a ``tokenizers.Tokenizer`` from the vocabulary stored in GGUF metadata.

A GGUF carries tokens, merges and token types but no tokenizer.json, so the
pre-tokenizer is chosen from ``tokenizer.ggml.pre`` to match what the model's
original tokenizer.json (and llama.cpp's llama-vocab.cpp) does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import tokenizers

from kvmosaic.model.weight_cache import CacheSource, cached_text

_MISSING = object()
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTE_LEVEL_NO_REGEX = {**_BYTE_LEVEL, "use_regex": False}
_DIGITS = {"type": "Digits", "individual_digits": True}

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _split_then_bytes(regex: str) -> dict:
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _BYTE_LEVEL_NO_REGEX]}


# tokenizer.ggml.pre -> (pre_tokenizer, normalizer, ignore_merges), grouped as llama-vocab.cpp groups them.
_GPT2_STYLE = (_BYTE_LEVEL, None, False)
_DIGITS_THEN_GPT2 = ({"type": "Sequence", "pretokenizers": [_DIGITS, _BYTE_LEVEL]}, None, False)
_QWEN2_STYLE = (_split_then_bytes(_QWEN2_SPLIT), {"type": "NFC"}, False)
_LLAMA3_STYLE = (_split_then_bytes(_LLAMA3_SPLIT), None, True)
PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), _GPT2_STYLE),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), _DIGITS_THEN_GPT2
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2_STYLE),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"), _LLAMA3_STYLE),
}


def gguf_field(fields: Mapping, key: str, default=_MISSING):
    """The Python value of a GGUF metadata key (scalars, strings, arrays)."""
    field = fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata is missing required key {key!r}")
        return default
    return field.contents()


def gguf_eos_token_ids(fields: Mapping) -> tuple[int, ...]:
    """EOS plus end-of-turn / end-of-message tokens: llama.cpp stops on all of them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = (gguf_field(fields, key, None) for key in keys)
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def gguf_tokenizer_args(fields: Mapping, cache_path: Path | None = None) -> dict:
    """Keyword arguments for ``Tokenizer(...)`` described by the GGUF metadata. ``cache_path``: the
    GGUF file, whose tokenizer description is kept in the weight cache (``cached_text``)."""
    model = gguf_field(fields, "tokenizer.ggml.model", None)
    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2') vocabularies "
            "are (sentencepiece 'llama' vocabularies need an HF directory with tokenizer.json)"
        )
    tokens = gguf_field(fields, "tokenizer.ggml.tokens")
    bos_id = gguf_field(fields, "tokenizer.ggml.bos_token_id", None)
    eos_ids = gguf_eos_token_ids(fields)
    return {
        "backend": build_byte_level_bpe(fields, cache_path),
        "bos_token": tokens[bos_id] if bos_id is not None else None,
        "eos_token": tokens[eos_ids[0]] if eos_ids else None,
        "eos_token_ids": eos_ids,
        # llama.cpp and HF both default to no BOS for byte-level vocabularies that do not say.
        "add_bos_token": bool(gguf_field(fields, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": gguf_field(fields, "tokenizer.chat_template", None),
    }


def build_byte_level_bpe(fields: Mapping, cache_path: Path | None = None) -> tokenizers.Tokenizer:
    """The tokenizer; with ``cache_path`` its JSON description comes from (or goes to) the weight cache,
    keyed by the file and this module's code (building it is most of a large vocabulary's load)."""
    if cache_path is None:
        return tokenizers.Tokenizer.from_str(byte_level_bpe_json(fields))
    source = CacheSource(cache_path, {"tokenizer_code": _code_digest()})
    return tokenizers.Tokenizer.from_str(cached_text(source, "tokenizer.json", lambda: byte_level_bpe_json(fields)))


def _code_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def byte_level_bpe_json(fields: Mapping) -> str:
    """The tokenizers library's JSON description of the GGUF's byte-level BPE vocabulary."""
    pre = gguf_field(fields, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(PRE_TOKENIZERS)}")
    pre_tokenizer, normalizer, ignore_merges = PRE_TOKENIZERS[pre]
    tokens = gguf_field(fields, "tokenizer.ggml.tokens")
    merges = gguf_field(fields, "tokenizer.ggml.merges", [])
    token_types = gguf_field(fields, "tokenizer.ggml.token_type", [1] * len(tokens))
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, token_types),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": merges,
        },
    }
    return json.dumps(spec)


def _added_tokens(tokens: list[str], token_types: list[int]) -> list[dict]:
    """Control and user-defined tokens are matched whole in raw text, with their GGUF ids."""
    keep = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    return [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": token_type == TOKEN_TYPE_CONTROL,
        }
        for i, (token, token_type) in enumerate(zip(tokens, token_types))
        if token_type in keep
    ]
