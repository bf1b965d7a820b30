"""llama.cpp's divergence of GGUF files from its own run of a reference (float) GGUF, per token.

    <llamacpp venv>/bin/python llamacpp_kl.py WINDOWS.json THREADS REFERENCE.gguf MODEL.gguf [MODEL.gguf ...]

Runs in the llama-cpp-python venv (llama_cpp and numpy; this folder's ``divergence`` and
``llamacpp_ppl`` modules, not the kvmosaic package). Each window of WINDOWS.json (lists of token ids)
runs from an empty cache in one batch, float32 KV, on the reference and on every model; the positions
that predict ids[1:] are compared. Prints one JSON line: per model path its per-token KL and top-1
agreement, and llama.cpp's system info.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from divergence import log_softmax, token_divergence
from llamacpp_ppl import open_model, system_info, window_logits


def main() -> int:
    windows_file, threads, reference, models = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    windows = json.loads(Path(windows_file).read_text())
    n_ctx = max(len(w) for w in windows)
    llm = open_model(reference, n_ctx, threads)
    references = [log_softmax(window_logits(llm, ids)) for ids in windows]
    del llm
    result = {}
    for model in models:
        llm = open_model(model, n_ctx, threads)
        kl, same = [], []
        for ids, ref in zip(windows, references, strict=True):
            window_kl, window_same = token_divergence(ref, window_logits(llm, ids))
            kl += window_kl.tolist()
            same += window_same.tolist()
        result[model] = {"kl": kl, "top1": same}
        del llm
    print(json.dumps({"models": result, "system_info": system_info()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
