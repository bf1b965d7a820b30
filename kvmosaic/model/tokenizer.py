"""Text <-> token ids, chat templates and streaming detokenization.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` built either from a Hugging Face
``tokenizer.json`` or from the vocabulary a GGUF file stores in its metadata.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import processors

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


_LONG_TEXT = 4096  # characters: below it the plain call is faster than the batch call's thread hand-off


class Tokenizer:
    """Encode/decode plus the special tokens and chat template of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        self.eos_token_ids: tuple[int, ...] = _unique([*([] if eos_id is None else [eos_id]), *eos_token_ids])
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        # None trusts the backend's post-processor (tokenizer.json already encodes the model's choice).
        if add_bos_token is not None:
            self._set_add_bos(add_bos_token)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader_fields: Mapping, cache_path: Path | None = None) -> Tokenizer:
        """Build from ``GGUFReader.fields`` (``tokenizer.ggml.*`` keys); ``cache_path``: the GGUF file,
        whose tokenizer description the weight cache keeps."""
        from kvmosaic.model.gguf_tokenizer import gguf_tokenizer_args

        return cls(**gguf_tokenizer_args(reader_fields, cache_path))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` plus the special tokens and template in ``tokenizer_config.json``."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            eos_token_ids=_as_id_list(generation.get("eos_token_id")),
            add_bos_token=config.get("add_bos_token"),
            chat_template=_hf_chat_template(path, config),
        )

    # -- encode / decode ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG_TEXT:  # the batch call releases the GIL, so other threads (the server) go on
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for (its vocabulary string: one
        character per byte in byte-level vocabularies, at least one per character otherwise)."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _LONG_TEXT:  # as for encode: the batch call releases the GIL
            return self._backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        specials = self._backend.get_added_tokens_decoder()
        return sorted(i for i, token in specials.items() if token.special)

    @property
    def add_bos_token(self) -> bool:
        return self.bos_token_id is not None and self.encode("")[:1] == [self.bos_token_id]

    def to_json(self) -> str:
        return self._backend.to_str()

    # -- chat -------------------------------------------------------------------------------------
    @property
    def chat_template_takes_tools(self) -> bool:
        return self.chat_template is not None and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render a conversation with the model's own jinja2 template (``tools``: function specs, for a
        template that takes them)."""
        validate_messages(messages)
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        if self._template is None:
            self._template = _chat_environment().from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def _set_add_bos(self, add_bos: bool) -> None:
        if add_bos == self.add_bos_token:
            return
        if not add_bos:
            self._backend.post_processor = None
        elif self.bos_token_id is None:
            raise ValueError("add_bos_token is set but the model names no BOS token")
        else:
            bos = self.bos_token
            self._backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, self.bos_token_id)]
            )


def validate_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if message.get("role") not in CHAT_ROLES:
            raise ValueError(f"messages[{i}] has role {message.get('role')!r}; expected one of {sorted(CHAT_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] content must be a string")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a UTF-8 character.

    Like vLLM's prefix/read offsets: each step decodes only a short window (the tokens of the
    last emitted delta plus the pending ones) and emits what the new tokens added to it.
    """

    CONTEXT_TOKENS = 5  # prompt tokens decoded as context so the first delta has the right spacing

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._window = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        self._read = len(self._window)  # window[:_read] is context already emitted; the rest is pending

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        self._window.extend(new_ids)
        prefix = self._tokenizer.decode(self._window[: self._read], self._skip_special)
        text = self._tokenizer.decode(self._window, self._skip_special)
        # A trailing U+FFFD is a multi-byte character still missing bytes: wait for the next token.
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return text[len(prefix) :]


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False) -> str:
    # Templates expect unescaped unicode, which jinja2's built-in tojson does not give.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template rejected the conversation: {message}")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: str | dict | None) -> str | None:
    # tokenizer_config.json stores special tokens as strings or serialized AddedToken dicts.
    return token.get("content") if isinstance(token, dict) else token


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _hf_chat_template(path: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template


def _unique(ids) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))
