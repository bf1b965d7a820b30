"""Make a real-size model shape's files once, for ``benchmarks/peers.py --model <shape>``.

    python benchmarks/make_models.py --model llama-3.2-1b [--formats bf16,q8_0,q4_k_m[,f32]] [--no-check]
    python benchmarks/make_models.py --model llama-3.2-3b --plan     # the disk it would take, nothing made
    python benchmarks/make_models.py --model llama-3.2-3b --remove   # delete that shape's files

Into .peers/models/<shape>/ (git-ignored): an HF directory with the real model's config.json and
random bf16 weights (peer_runners/random_weights.py), the bf16 GGUF made from it by llama.cpp's own
converter (convert_hf_to_gguf.py of the llama-cpp-python source package), f32 the same way (shapes
up to 1B only), and q8_0 / q4_k_m made from the bf16 GGUF by llama.cpp's own quantizer
(peer_runners/llamacpp_quantize.py; q4_k_m is llama.cpp's mix), so the files are what users
download. Needs the llamacpp peer (bash scripts/setup_peers.sh llamacpp). A file that exists is
kept. Then each GGUF is checked: kvmosaic and llama.cpp both load it and generate a few greedy
tokens (the tokens are printed; random weights make near-ties, so they need not agree).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from peer_runners.models import LLAMA_CPP_VERSION, PEERS, base_env, run_tool
from peer_runners.shape_files import DEFAULT_FORMATS, ShapeFiles, check_formats, check_shape, disk_plan
from peer_runners.shapes import SHAPES

LLAMACPP_PYTHON = PEERS / "llamacpp-venv" / "bin" / "python"
CONVERTER = PEERS / "src" / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
QUANTIZER = Path(__file__).resolve().parent / "peer_runners" / "llamacpp_quantize.py"
CHECK_PROMPT = [100 + 37 * i % 40000 for i in range(16)]
CHECK_TOKENS = 4
GB = 1e9

_KVMOSAIC_CHECK = """
import json, sys
from kvmosaic import LLM, SamplingParams
path, fmt, prompt, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
float_file = fmt in ("bf16", "f32")
llm = LLM(model=path, dtype={"bf16": "bfloat16"}.get(fmt, "float32"), quantization="none" if float_file else "auto",
          kv_cache_memory="256MiB", max_model_len=256, enable_prefix_caching=False)
out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
print(json.dumps(list(out[0].outputs[0].token_ids)))
"""
_LLAMACPP_CHECK = """
import json, sys
from itertools import islice
from llama_cpp import Llama
path, prompt, n = sys.argv[1], json.loads(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=256, n_threads=2, verbose=False)
tokens = llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
print(json.dumps(list(islice(tokens, n))))
"""


def make_hf_dir(files: ShapeFiles) -> None:
    if (files.hf_dir / "model.safetensors.index.json").is_file():
        return
    print(f"making {files.hf_dir} (random bf16 weights) ...", flush=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
            "from peer_runners.random_weights import write_hf_dir; from peer_runners.shapes import SHAPES; "
            "write_hf_dir(SHAPES[sys.argv[2]], Path(sys.argv[3]))")
    files.root.mkdir(parents=True, exist_ok=True)
    run_tool([sys.executable, "-c", code, Path(__file__).resolve().parent, files.key, files.hf_dir],
              f"HF directory {files.hf_dir.name} of {files.key}", timeout=7200)


def make_gguf(files: ShapeFiles, fmt: str) -> None:
    out = files.gguf(fmt)
    if out.is_file():
        return
    tmp = out.with_suffix(".tmp")
    if fmt in ("bf16", "f32"):
        run_tool([LLAMACPP_PYTHON, CONVERTER, files.hf_dir, "--outtype", fmt, "--outfile", tmp],
                  f"GGUF {out.name} (convert_hf_to_gguf.py)", timeout=7200)
    else:
        run_tool([LLAMACPP_PYTHON, QUANTIZER, files.gguf("bf16"), tmp, fmt], f"GGUF {out.name} (llama.cpp quantizer)",
                  timeout=7200)
    tmp.rename(out)


def check_file(path: Path, fmt: str) -> dict[str, list[int] | str]:
    """Greedy tokens of kvmosaic and llama.cpp on ``path`` (or the last lines of an error)."""
    args = [str(path), fmt, json.dumps(CHECK_PROMPT), str(CHECK_TOKENS)]
    found = {}
    for engine, python, code in (("kvmosaic", sys.executable, _KVMOSAIC_CHECK),
                                 ("llama.cpp", LLAMACPP_PYTHON, _LLAMACPP_CHECK)):
        done = subprocess.run(["nice", "-n", "19", str(python), "-c", code, *args], capture_output=True, text=True,
                              env=base_env(), timeout=3600)
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            found[engine] = json.loads(lines[-1])
        else:
            found[engine] = "FAILED: " + " | ".join(done.stderr.strip().splitlines()[-4:])[-600:]
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(SHAPES))
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="of bf16, f32, q8_0, q4_k_m")
    parser.add_argument("--no-check", action="store_true", help="skip loading each file in kvmosaic and llama.cpp")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--plan", action="store_true", help="print the files and their estimated sizes, make nothing")
    action.add_argument("--remove", action="store_true", help="delete this shape's directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = check_shape(args.model)
    formats = check_formats(shape, args.formats.split(","))
    files = ShapeFiles(args.model)
    plan = disk_plan(shape, formats)
    print(f"{shape.name}: {shape.num_params() / 1e9:.2f}B parameters; files (estimated): "
          + ", ".join(f"{name} {size / GB:.1f} GB" for name, size in plan.items())
          + f"; total {sum(plan.values()) / GB:.1f} GB in {files.root}")
    if args.plan:
        return 0
    if args.remove:
        shutil.rmtree(files.root, ignore_errors=True)
        print(f"removed {files.root}")
        return 0
    if not (LLAMACPP_PYTHON.is_file() and CONVERTER.is_file()):
        raise SystemExit("llama.cpp's converter is missing: bash scripts/setup_peers.sh llamacpp")
    make_hf_dir(files)
    for fmt in ["bf16", *(f for f in formats if f != "bf16")]:  # bf16 first: the quantizer's source
        make_gguf(files, fmt)
    failed = False
    for fmt in [] if args.no_check else formats:
        found = check_file(files.gguf(fmt), fmt)
        failed |= any(isinstance(v, str) for v in found.values())
        print(f"check {files.gguf(fmt).name}: " + "; ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    used = sum(p.stat().st_size for p in files.root.rglob("*") if p.is_file())
    print(f"{files.root}: {used / GB:.1f} GB on disk")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
