"""Tokenizer: token ids and chat template match transformers; streaming detokenization is exact."""

from __future__ import annotations

import json
import os

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmosaic.model.gguf_tokenizer import build_byte_level_bpe, gguf_tokenizer_args
from kvmosaic.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "1,000,000 and 2024-01-01: 99 bottles, 3.14159",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "你好，世界！这是一个测试。",
    "こんにちは世界",
    "emoji 🙂👍🏽🇫🇷 mix",
    "   leading and trailing   ",
    "tabs\t\tand\nnew\n\nlines\r\n",
    "<|im_end|>",
    "before<|im_start|>user\nhi<|im_end|>after",
    "I'm sure they'll say WE'VE done it",
    "Ünïcödé café naïve résumé",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🐔 你好"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path):
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(default_model_path)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def tok(default_model) -> Tokenizer:
    return default_model.tokenizer


def test_token_ids_match_transformers(tok, hf_tokenizer):
    for text in TEXTS:
        assert tok.encode(text) == hf_tokenizer.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)


def test_decode_matches_transformers(tok, hf_tokenizer):
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(messages, add_generation_prompt) == expected


def test_smollm2_special_tokens(tok):
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token_ids == (2,) and tok.eos_token == "<|im_end|>"
    assert tok.vocab_size == 49152
    assert tok.id_to_token(2) == "<|im_end|>"
    assert {0, 1, 2} <= set(tok.all_special_ids)
    assert not tok.add_bos_token
    assert tok.encode("<|im_start|>assistant") == [1, 520, 9531]
    assert tok.decode([1, 520, 9531]) == "assistant"
    assert tok.decode([1, 520, 9531], skip_special_tokens=False) == "<|im_start|>assistant"


def test_digits_split_individually(tok):
    # SmolLM2's real tokenizer.json pre-splits every digit (Digits(individual_digits=True)).
    ids = tok.encode("2024")
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"role": "user"}],
        [{"role": "robot", "content": "hi"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": None}],
        ["user: hi"],
    ],
)
def test_chat_template_rejects_bad_messages(tok, messages):
    with pytest.raises(ValueError):
        tok.apply_chat_template(messages)


def _copy(tok: Tokenizer, **kwargs) -> Tokenizer:
    backend = tokenizers.Tokenizer.from_str(tok.to_json())
    args = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}
    return Tokenizer(backend, **{**args, **kwargs})


def test_template_raise_exception_and_missing_template(tok):
    strict = _copy(tok, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no chat template"):
        _copy(tok, chat_template=None).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_gets_bos_eos_and_tojson(tok):
    template = "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}{{ eos_token }}"
    rendered = _copy(tok, chat_template=template).apply_chat_template([{"role": "user", "content": "é"}])
    assert rendered == '<|im_start|>{"role": "user", "content": "é"}<|im_end|>'


def test_add_bos_token_switch(tok):
    with_bos = _copy(tok, add_bos_token=True)
    assert with_bos.add_bos_token
    assert with_bos.encode("hi") == [1, *tok.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == tok.encode("hi")
    assert not _copy(with_bos, add_bos_token=False).add_bos_token


def test_from_hf_dir(tok, tmp_path):
    (tmp_path / "tokenizer.json").write_text(tok.to_json())
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.bos_token_id == 1 and loaded.eos_token_ids == (2, 0)
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    assert loaded.encode(TEXTS[6]) == tok.encode(TEXTS[6])


def test_from_hf_dir_reads_chat_template_jinja(tok, tmp_path):
    (tmp_path / "tokenizer.json").write_text(tok.to_json())
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "1"
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_hf_dir(tmp_path / "missing")


# -- GGUF vocabulary variants (fake metadata fields) -----------------------------------------------


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


def _fields(**overrides) -> dict:
    tokens = ["<s>", "</s>", *[chr(c) for c in range(33, 127)], "Ġ"]
    values = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, *[1] * (len(tokens) - 2)],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        **overrides,
    }
    return {key: _Field(value) for key, value in values.items()}


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("default", ["a", "Ġ12345"]),
        ("smollm", ["a", "Ġ", "1", "2", "3", "4", "5"]),
        ("qwen2", ["a", "Ġ", "1", "2", "3", "4", "5"]),
        ("llama-bpe", ["a", "Ġ", "123", "45"]),
    ],
)
def test_gguf_pre_tokenizers(pre, pieces):
    backend = build_byte_level_bpe(_fields(**{"tokenizer.ggml.pre": pre}))
    assert [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str("a 12345")] == pieces


def test_gguf_tokenizer_args_and_errors():
    args = gguf_tokenizer_args(_fields(**{"tokenizer.ggml.eot_token_id": 0, "tokenizer.ggml.add_bos_token": True}))
    tok = Tokenizer(**args)
    assert tok.eos_token_ids == (1, 0) and tok.bos_token_id == 0
    assert tok.encode("ab</s>") == [0, 66, 67, 1]  # "!" is id 2, so "a" is 2 + 97 - 33
    with pytest.raises(ValueError, match="'llama'"):
        gguf_tokenizer_args(_fields(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="'mystery'"):
        gguf_tokenizer_args(_fields(**{"tokenizer.ggml.pre": "mystery"}))


# -- incremental detokenization ---------------------------------------------------------------


def _stream(tok: Tokenizer, prompt: list[int], output: list[int], step: int = 1, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip)
    return [detok.add_tokens(output[i : i + step]) for i in range(0, len(output), step)]


@pytest.mark.parametrize("step", [1, 2, 3])
def test_stream_cjk_and_emoji(tok, step):
    text = "Hello 你好世界！🙂👍🏽 naïve 🇫🇷 ok… done"
    output = tok.encode(text)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    chunks = _stream(tok, prompt, output, step)
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) == tok.decode(output) == text
    assert sum(1 for chunk in chunks if chunk == "") > 0  # multi-byte characters were held back


def test_stream_special_tokens(tok):
    output = tok.encode("Sure.<|im_end|>")
    assert "".join(_stream(tok, [], output)) == "Sure."
    assert "".join(_stream(tok, [], output, skip=False)) == "Sure.<|im_end|>"


def test_stream_decodes_a_bounded_window(tok):
    calls: list[int] = []

    class Spy(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    spy = Spy(tokenizers.Tokenizer.from_str(tok.to_json()))
    output = tok.encode("word " * 300 + "你好" * 50)
    assert "".join(_stream(spy, tok.encode("prompt " * 100), output)) == tok.decode(output)
    assert max(calls) <= 10


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_stream_equals_full_decode(default_model, text):
    tok = default_model.tokenizer
    output = tok.encode(text, add_special_tokens=False)
    chunks = _stream(tok, tok.encode("Q: "), output)
    full = tok.decode(output)
    if not full.endswith("\ufffd"):
        assert "".join(chunks) == full
