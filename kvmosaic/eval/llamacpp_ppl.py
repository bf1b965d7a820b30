"""llama.cpp's negative log-likelihood of token windows: the external perplexity oracle.

    <llamacpp venv>/bin/python llamacpp_ppl.py WINDOWS.json THREADS MODEL.gguf

Runs in the llama-cpp-python venv (llama_cpp and numpy only; kvmosaic is not importable there).
WINDOWS.json holds lists of token ids; each window is evaluated from an empty KV cache in one
batch with ``logits_all`` and every position 1..n-1 is scored (the convention of
``kvmosaic.eval.ppl``, not llama-perplexity's second half). The KV cache is float32 so only the
weight format differs between the engines. Prints one JSON line: per window [nll sum, count].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GGML_TYPE_F32 = 0


def open_model(model: str, n_ctx: int, threads: int):
    """A llama.cpp context for windows of up to ``n_ctx`` tokens, each in one batch, logits of every
    position, float32 KV."""
    from llama_cpp import Llama

    return Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, n_threads=threads,
                 n_threads_batch=threads, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False)


def window_logits(llm, ids: list[int]):
    """Logits [n - 1, vocab] (float64) of the positions that predict ids[1:], from an empty cache."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)


def window_nll(llm, ids: list[int]) -> float:
    import numpy as np
    from divergence import log_softmax  # this script's folder is on sys.path: kvmosaic is not importable here

    logprobs = log_softmax(window_logits(llm, ids))
    return -float(logprobs[np.arange(len(ids) - 1), ids[1:]].sum())


def system_info() -> str:
    from llama_cpp import llama_print_system_info

    return llama_print_system_info().decode().strip()


def main() -> int:
    windows_file, threads, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    windows = json.loads(Path(windows_file).read_text())
    llm = open_model(model, max(len(w) for w in windows), threads)
    rows = [[window_nll(llm, w), len(w) - 1] for w in windows]
    print(json.dumps({"windows": rows, "system_info": system_info()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
