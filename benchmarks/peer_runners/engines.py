"""The engines peers.py compares and how one (engine, dtype, workload) runs: each in its own venv and
subprocess (peer_runners/<engine>_runner.py), which prints one JSON line."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from peer_runners.footprint import weights_bytes
from peer_runners.machine_load import children_cpu_seconds, cpu_busy_seconds
from peer_runners.models import PEERS, ROOT, THREADS, base_env

RUNNERS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Engine:
    key: str
    label: str
    venv: Path | None  # None: the main venv running this script
    env: dict = field(default_factory=dict)

    @property
    def python(self) -> Path:
        return Path(sys.executable) if self.venv is None else self.venv / "bin" / "python"

    @property
    def runner(self) -> Path:
        return RUNNERS / f"{self.key}_runner.py"

    def missing(self) -> str | None:
        """Why this engine cannot run here, or None."""
        if self.key == "hf" and importlib.util.find_spec("transformers") is None:
            return "transformers is not installed in the main venv (pip install -e '.[dev]')"
        if self.venv is not None and not (self.venv / ".installed").is_file():
            return f"{self.venv.relative_to(ROOT)} is not set up (bash scripts/setup_peers.sh {self.key})"
        return None


def _vllm_preload() -> str:
    """tcmalloc and Intel OpenMP preloaded, as vLLM's CPU guide asks (about 1.5x faster decode here)."""
    libs = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), PEERS / "vllm-venv" / "lib" / "libiomp5.so"]
    return ":".join(str(lib) for lib in libs if lib.is_file())


# --isa-cap avx2: every engine on its AVX2 code paths, so an AVX-512 host also measures what an
# AVX2+FMA host runs (same CPU otherwise: an approximation of an AVX2 host, not a substitute).
# torch (kvmosaic, HF) caps ATen and oneDNN; kvmosaic loads its avx2 kernels; llama.cpp runs a
# build without AVX-512 (bash scripts/setup_peers.sh llamacpp-avx2); CTranslate2 forces its ISA.
# vLLM picks its kernels from the CPU's flags, so it cannot be capped and is left out.
AVX2_CAP_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2", "KVMOSAIC_ISA": "avx2", "CT2_FORCE_CPU_ISA": "AVX2"}


def capped(engine: Engine) -> Engine | None:
    """The engine with its AVX2 code paths forced, or None when it cannot be capped."""
    if engine.key == "vllm":
        return None
    venv = PEERS / "llamacpp-avx2-venv" if engine.key == "llamacpp" else engine.venv
    return Engine(engine.key, engine.label, venv, {**engine.env, **AVX2_CAP_ENV})


def with_scheduler_steps(engine: Engine, steps: int) -> Engine:
    """kvmosaic running ``steps`` forward passes per decode-only step (others unchanged)."""
    if engine.key != "kvmosaic":
        return engine
    return Engine(engine.key, f"kvmosaic ({steps} steps)", engine.venv,
                  {**engine.env, "KVMOSAIC_SCHEDULER_STEPS": str(steps)})


def with_kv_cache_dtype(engine: Engine, kv_cache_dtype: str) -> Engine:
    """kvmosaic storing its KV cache as ``kv_cache_dtype`` (others unchanged)."""
    if engine.key != "kvmosaic":
        return engine
    return Engine(engine.key, f"{engine.label} (KV {kv_cache_dtype})", engine.venv,
                  {**engine.env, "KVMOSAIC_KV_CACHE_DTYPE": kv_cache_dtype})


ENGINES = [
    Engine("kvmosaic", "kvmosaic", None),
    Engine("hf", "HF transformers", None),
    Engine("vllm", "vLLM", PEERS / "vllm-venv",
           {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
            "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "LD_PRELOAD": _vllm_preload()}),
    Engine("llamacpp", "llama.cpp", PEERS / "llamacpp-venv"),
    Engine("ct2", "CTranslate2", PEERS / "ct2-venv"),
]


def run_one(engine: Engine, dtype: str, workload: str, timeout: float, model: Path | None) -> dict:
    """Run a runner on ``model`` (None: the runner's default) in its own process group; returns its JSON
    result or {"error": ...}, with the model's weight bytes.

    ``other_cpu_share`` is the CPU share that processes other than this run used meanwhile.
    """
    cmd = [str(engine.python), str(engine.runner), "--workload", workload, "--dtype", dtype,
           "--threads", str(THREADS)]
    if model is not None:
        cmd += ["--model-path", str(model)]
    env = {**base_env(), **engine.env}
    busy, own, start = cpu_busy_seconds(), children_cpu_seconds(), time.monotonic()
    cmd += ["--t0", repr(time.time())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=RUNNERS, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and any engine workers it spawned
        proc.communicate()
        return {"error": f"timeout after {timeout:.0f} s"}
    wall = time.monotonic() - start
    others = (cpu_busy_seconds() - busy) - (children_cpu_seconds() - own)
    result = _parse_result(out) or {"error": f"exit code {proc.returncode}: "
                                             + " | ".join(err.strip().splitlines()[-6:])[-800:]}
    result["other_cpu_share"] = max(0.0, others) / (wall * (os.cpu_count() or 1))
    if engine.key != "ct2" and (sizes := weights_bytes(model, dtype)) is not None:
        result.update(weights_bytes=sizes.held, weights_read_bytes=sizes.read_per_token)
    return result


def _parse_result(stdout: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None
