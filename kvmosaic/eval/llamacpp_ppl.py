"""llama.cpp's negative log-likelihood of token windows: the external perplexity oracle.

    <llamacpp venv>/bin/python llamacpp_ppl.py MODEL.gguf WINDOWS.json THREADS

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


def window_nll(llm, ids: list[int]) -> float:
    import numpy as np

    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    chosen = logits[np.arange(len(ids) - 1), ids[1:]]
    return float((log_norm - chosen).sum())


def main() -> int:
    from llama_cpp import Llama, llama_print_system_info

    model, windows_file, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    windows = json.loads(Path(windows_file).read_text())
    n_ctx = max(len(w) for w in windows)
    llm = Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=threads, n_threads_batch=threads, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32,
                verbose=False)
    rows = [[window_nll(llm, w), len(w) - 1] for w in windows]
    print(json.dumps({"windows": rows, "system_info": llama_print_system_info().decode().strip()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
