"""The kvmosaic command line, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmosaic import LLM, SamplingParams

CLI = [sys.executable, "-m", "kvmosaic.entrypoints.cli"]


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, input=stdin, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_generate_streams_the_greedy_completion(cached_loader):
    """Streamed with four passes a decode step (multi-step decoding): the text of one pass a step."""
    prompt = "The capital of France is"
    proc = _run(["generate", prompt, "--max-tokens", "16", "--temperature", "0", "--dtype", "float32",
                 "--quantization", "none", "--num-scheduler-steps", "4"])
    assert proc.returncode == 0, proc.stderr
    llm = LLM(model_loader=cached_loader, dtype="float32", kv_cache_memory="64MiB")
    expected = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert proc.stdout == prompt + expected[0].outputs[0].text + "\n"


@pytest.mark.slow
def test_chat_answers_and_exits(cached_loader):
    proc = _run(["chat", "--max-tokens", "24", "--temperature", "0", "--dtype", "float32", "--quantization", "none"],
                stdin="Name three colors.\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    llm = LLM(model_loader=cached_loader, dtype="float32", kv_cache_memory="64MiB")
    expected = llm.chat([{"role": "user", "content": "Name three colors."}],
                        SamplingParams(temperature=0.0, max_tokens=24))
    assert expected[0].outputs[0].text.strip() in proc.stdout


def test_bad_arguments_exit_with_a_message():
    proc = _run(["generate", "hi", "--temperature", "-1"])
    assert proc.returncode == 2 and "temperature" in proc.stderr
    proc = _run(["generate", "hi", "--model", "/nonexistent.gguf"])
    assert proc.returncode == 2 and "nonexistent" in proc.stderr
    proc = _run(["generate", "hi", "--num-scheduler-steps", "0"])
    assert proc.returncode == 2 and "num_scheduler_steps" in proc.stderr
