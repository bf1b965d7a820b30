"""llama.cpp as an external perplexity oracle for a GGUF file and kvmosaic's run of the same file.

Both engines get the same token ids (windows cut by ``tokenize_windows``, never text), each window
from an empty cache in one pass, every position 1..n-1 scored (kvmosaic's eval-ppl convention;
llama-perplexity would score only the second half of each window). llama.cpp runs in the peers venv
(``bash scripts/setup_peers.sh llamacpp``; ``KVMOSAIC_LLAMACPP_VENV`` names another) through
``llamacpp_ppl.py``, with a float32 KV cache so that only the weights differ.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvmosaic.eval.harness import EvalModel
from kvmosaic.eval.ppl import perplexity

REPO = Path(__file__).resolve().parents[2]
RUNNER = "llamacpp_ppl.py"
AGREEMENT = 0.01  # the two engines' perplexities must agree within 1%


def llamacpp_venv() -> Path:
    return Path(os.environ.get("KVMOSAIC_LLAMACPP_VENV", REPO / ".peers" / "llamacpp-venv"))


def llamacpp_missing() -> str | None:
    """Why llama.cpp cannot be run here, or None."""
    venv = llamacpp_venv()
    if not (venv / ".installed").is_file() or not (venv / "bin" / "python").is_file():
        return f"no llama-cpp-python venv at {venv} (bash scripts/setup_peers.sh llamacpp)"
    return None


@dataclass(frozen=True, slots=True)
class LlamaCppPerplexity:
    nll_sum: float
    num_tokens: int
    system_info: str

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.num_tokens)


def run_llamacpp(script: str, windows: list[list[int]], ggufs: list[str | Path], threads: int,
                 timeout: float) -> dict:
    """Run ``script`` (a runner beside this module: ``WINDOWS.json THREADS GGUF...``) in the llama.cpp venv
    on ``windows`` (token ids); returns the JSON of its last output line."""
    missing = llamacpp_missing()
    if missing:
        raise RuntimeError(missing)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as spec:
        json.dump(windows, spec)
        spec.flush()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        argv = [str(llamacpp_venv() / "bin" / "python"), str(Path(__file__).with_name(script)), spec.name,
                str(threads), *map(str, ggufs)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp {script} failed: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llamacpp_perplexity(gguf: str | Path, windows: list[list[int]], threads: int = 2,
                        timeout: float = 1800) -> LlamaCppPerplexity:
    """llama.cpp's perplexity of ``windows`` (token ids) under the model in ``gguf``."""
    result = run_llamacpp(RUNNER, windows, [gguf], threads, timeout)
    rows = result["windows"]
    return LlamaCppPerplexity(sum(r[0] for r in rows), sum(r[1] for r in rows), result["system_info"])


def tensor_types(gguf: str | Path) -> str:
    """The weight formats of a GGUF's matrices, e.g. "Q4_K x30, Q5_0 x181" (1-D norms left out)."""
    from kvmosaic.model.gguf_file import GGUFFile

    reader = GGUFFile(gguf)
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1 and t.shape[1] > 1)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


def held_formats(weights: Mapping[str, object]) -> str:
    """How kvmosaic holds a loaded model's matrices, e.g. "Q5_0 as Q8_0 x181, Q4_K x30" (1-D left out)."""
    from kvmosaic.quant.weights import QuantizedWeight

    counts = Counter(w.source if isinstance(w, QuantizedWeight) else str(w.dtype).removeprefix("torch.")
                     for w in weights.values() if isinstance(w, QuantizedWeight) or w.dim() == 2)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


@dataclass(frozen=True, slots=True)
class OracleRow:
    label: str
    gguf: str
    tensor_types: str
    weight_format: str  # kvmosaic's load mode of the file ("auto": native, "none": dequantized)
    num_tokens: int
    kvmosaic: float
    llamacpp: float
    kvmosaic_s: float
    llamacpp_info: str  # llama.cpp's system info: the CPU features its build uses
    held: str = ""  # how kvmosaic holds the matrices (held_formats)

    @property
    def difference(self) -> float:
        """kvmosaic's perplexity relative to llama.cpp's (0.01 = 1% higher)."""
        return self.kvmosaic / self.llamacpp - 1

    @property
    def agrees(self) -> bool:
        return abs(self.difference) <= AGREEMENT


def compare(label: str, gguf: str | Path, em: EvalModel, windows: list[list[int]],
            threads: int = 2) -> OracleRow:
    """kvmosaic (``em``, loaded from ``gguf``) against llama.cpp on the same file and windows."""
    ours = perplexity(em, windows, "auto", chunk=max(len(w) for w in windows))
    theirs = llamacpp_perplexity(gguf, windows, threads)
    if theirs.num_tokens != ours.num_tokens:
        raise RuntimeError(f"scored {ours.num_tokens} tokens here and {theirs.num_tokens} in llama.cpp")
    return OracleRow(label, str(gguf), tensor_types(gguf), em.weight_format, ours.num_tokens, ours.perplexity,
                     theirs.perplexity, ours.seconds, theirs.system_info, held_formats(em.loaded.weights))
