"""Quantized linears of the default model: ``ops.quantized_linear`` against the packed float kernel.

For every projection shape of SmolLM2-135M and a few row counts: microseconds per call and the
weight bytes streamed per second, for Q8_0, Q4_1 and Q4_K weights next to the packed float weight of
the activations' dtype, best of a few repeats, interleaved in one run. Decode rows take the int8 dot
products; where the kernels have AMX tiles (Intel), products of ``ops.AMX_MIN_ROWS`` rows or more run
on the tiles with the weights dequantized to bf16, and each format also gets an "int8" column with
the tiles switched off (the same rows, the path every other CPU runs). Prints a table and writes JSON.

    .venv/bin/python benchmarks/qlinear.py [--rows 1,4,64,512] [--dtype float32] [--threads 2] [--level avx2]
                                           [--out PATH]
"""

from __future__ import annotations

import argparse

import torch
from bench_results import add_output_arg, write_record
from linear import SHAPES, time_call

from kvmosaic.ops import Kernels
from kvmosaic.ops.cpu import isa_summary
from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw

FORMATS = ("q8_0", "q4_1", "q4_k")


def tile_modes(ops) -> list[bool]:
    """The AMX switch positions to measure: on and off where the tiles exist, else only off."""
    return [True, False] if ops.amx_supported() else [False]


def measure(ops, n: int, k: int, rows: int, dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """Column -> (microseconds per call, GB/s of weight bytes)."""
    w = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k).to(dtype)
    results = {}
    packed = ops.pack_linear_weight(w.to(dtype))
    seconds = min(time_call(lambda: ops.packed_linear(x, packed)) for _ in range(3))
    results[str(dtype).removeprefix("torch.")] = (seconds * 1e6, packed.nbytes / seconds / 1e9)
    before = ops.amx_enabled()
    try:
        for fmt in FORMATS:
            q = qi.interleave(qw.quantize(w, fmt))
            best = {tiles: float("inf") for tiles in tile_modes(ops)}
            for _ in range(3):  # the switch positions alternate within the repeats
                for tiles in best:
                    ops.set_amx(tiles)
                    seconds = time_call(lambda q=q: ops.quantized_linear(x, q.codes, q.scale, q.extra))
                    best[tiles] = min(best[tiles], seconds)
            for tiles, seconds in best.items():
                name = fmt if tiles or len(best) == 1 else f"{fmt} int8"
                results[name] = (seconds * 1e6, q.nbytes / seconds / 1e9)
    finally:
        ops.set_amx(before)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,64")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="activations")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--level", default=None, help="kernel level (default: the best built)")
    add_output_arg(parser, "qlinear")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernels = Kernels.load(level=args.level)
    if not kernels.has("quantized_linear"):
        raise SystemExit("the C++ kernels are not built: python -m kvmosaic.ops.build")
    ops = kernels.ops
    tiles = f"AMX tiles from {ops.AMX_MIN_ROWS} rows" if ops.amx_supported() else "no AMX tiles"
    print(f"host ISA: {isa_summary()}; level {kernels.level}, {tiles}, {args.threads} threads, {args.dtype} "
          "activations; us per call (weight GB/s)")
    rows_out, header = [], False
    for name, (n, k) in SHAPES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            result = measure(kernels.ops, n, k, rows, dtype)
            if not header:
                print(f"{'shape':8s} {'rows':>5s} " + " ".join(f"{c:>18s}" for c in result))
                header = True
            cells = " ".join(f"{us:9.1f} ({gbs:5.1f})" for us, gbs in result.values())
            print(f"{name:8s} {rows:5d} {cells}", flush=True)
            cells_json = {c: {"us": us, "gb_s": gbs} for c, (us, gbs) in result.items()}
            rows_out.append({"shape": name, "rows": rows, **cells_json})
    write_record("qlinear", rows_out, out=args.out, config=vars(args), isa_level=kernels.level)


if __name__ == "__main__":
    main()
