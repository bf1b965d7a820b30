"""Text prompts cost bounded work: a text that cannot fit the context is refused before it is
tokenized, and tokenizing a long one lets the other threads (the HTTP server's loop) run."""

from __future__ import annotations

import threading
import time

import pytest

from kvmosaic import LLM
from kvmosaic.engine.request_checks import tokenize_prompt


@pytest.fixture(scope="module")
def llm(cached_loader):
    return LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, model_loader=cached_loader)


def test_max_token_chars_bounds_every_token(llm):
    tokenizer = llm.tokenizer
    longest = max(len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size))
    assert longest <= tokenizer.max_token_chars < 4 * longest


def test_text_beyond_any_tokenization_is_refused_untokenized(llm, monkeypatch):
    tokenizer = llm.tokenizer
    limit = 512 * tokenizer.max_token_chars
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("a hopeless prompt was tokenized"))
    with pytest.raises(ValueError, match="more than 512 tokens"):
        tokenize_prompt(tokenizer, llm.engine.model_config.vocab_size, "a" * (limit + 1), 512)
    with pytest.raises(ValueError, match="more than 512 tokens"):
        llm.engine.add_request(None, "a" * (limit + 1))


def test_text_at_the_bound_is_tokenized_and_judged_by_its_tokens(llm):
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens; the context length is 512"):
        llm.engine.add_request(None, "word " * 600)


def test_long_text_is_encoded_exactly_and_leaves_the_gil(llm):
    tokenizer = llm.tokenizer
    text = "The quick brown fox, jumps over 12 lazy dogs! " * 20000
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        ids = tokenizer.encode(text)
    finally:
        done.set()
        thread.join()
    assert ids == tokenizer._backend.encode(text).ids
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.1  # the plain call held the GIL for its whole run
