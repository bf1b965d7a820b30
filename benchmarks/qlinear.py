"""Quantized linears of the default model: ``ops.quantized_linear`` against the packed float kernel.

For every projection shape of SmolLM2-135M and a few row counts (decode rows take the int8 path,
more rows the dequantized panels), float32 activations: microseconds per call and the weight bytes
streamed per second, for Q8_0, Q4_1 and Q4_K weights next to the packed float32 weight, best of a
few repeats, interleaved in one run. Prints a table and writes JSON.

    .venv/bin/python benchmarks/qlinear.py [--rows 1,4,64] [--threads 2] [--level avx2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from linear import SHAPES, time_call

from kvmosaic.ops import Kernels
from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw

FORMATS = ("q8_0", "q4_1", "q4_k")


def measure(ops, n: int, k: int, rows: int) -> dict[str, tuple[float, float]]:
    """Format -> (microseconds per call, GB/s of weight bytes)."""
    w = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k)
    results = {}
    packed = ops.pack_linear_weight(w)
    seconds = min(time_call(lambda: ops.packed_linear(x, packed)) for _ in range(3))
    results["float32"] = (seconds * 1e6, packed.nbytes / seconds / 1e9)
    for fmt in FORMATS:
        q = qi.interleave(qw.quantize(w, fmt))
        seconds = min(time_call(lambda q=q: ops.quantized_linear(x, q.codes, q.scale, q.min)) for _ in range(3))
        results[fmt] = (seconds * 1e6, q.nbytes / seconds / 1e9)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--level", default=None, help="kernel level (default: the best built)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = Kernels.load(level=args.level)
    if not kernels.has("quantized_linear"):
        raise SystemExit("the C++ kernels are not built: python -m kvmosaic.ops.build")
    print(f"level {kernels.level}, {args.threads} threads; us per call (weight GB/s)")
    print(f"{'shape':8s} {'rows':>5s} " + " ".join(f"{f:>18s}" for f in ("float32", *FORMATS)))
    rows_out = []
    for name, (n, k) in SHAPES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            result = measure(kernels.ops, n, k, rows)
            cells = " ".join(f"{us:9.1f} ({gbs:5.1f})" for us, gbs in result.values())
            print(f"{name:8s} {rows:5d} {cells}")
            cells_json = {f: {"us": us, "gb_s": gbs} for f, (us, gbs) in result.items()}
            rows_out.append({"shape": name, "rows": rows, **cells_json})
    if args.json:
        args.json.write_text(json.dumps({"level": kernels.level, "threads": args.threads, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
