"""Linear layers of the default model: the packed kernel against oneDNN and ``F.linear``.

For every projection shape of SmolLM2-135M (fused qkv, o, fused gate/up, down, LM head) and a range
of row counts (single-token decode to prefill chunks), in float32 and bfloat16: GFLOP/s of
``kvmosaic.ops.packed_linear`` on the packed weight, of oneDNN's matmul primitive
(``torch.ops.mkldnn._linear_pointwise``) and of ``F.linear`` on the dense weight, each the best of a
few timed repeats, all in one run and interleaved. Prints a table and writes JSON.

    .venv/bin/python benchmarks/linear.py [--rows 1,8,64,512] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_results import add_output_arg, write_record

from kvmosaic.ops import get_ops

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def time_call(fn, min_seconds: float = 0.05) -> float:
    """Seconds per call: calls are repeated until ``min_seconds`` have passed."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    add_output_arg(parser, "linear")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = get_ops()
    if ops is None:
        raise SystemExit("the C++ kernels are not built (python -m kvmosaic.ops.build)")
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        if not ops.packed_linear_supports(dtype, 16, 2):
            print(f"{dtype}: no packed kernel on this CPU, skipped")
            continue
        for name, (n, k) in SHAPES.items():
            gen = torch.Generator().manual_seed(0)
            w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
            packed = ops.pack_linear_weight(w)
            for rows in rows_list:
                x = torch.randn(rows, k, generator=gen).to(dtype)
                calls = {
                    "packed": lambda x=x, packed=packed: ops.packed_linear(x, packed),
                    "onednn": lambda x=x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                    "F.linear": lambda x=x, w=w: F.linear(x, w),
                }
                best = dict.fromkeys(calls, float("inf"))
                for _ in range(args.repeats):
                    for label, fn in calls.items():
                        best[label] = min(best[label], time_call(fn))
                flop = 2 * rows * n * k
                rates = {f"{label}_gflops": flop / s / 1e9 for label, s in best.items()}
                other = max(rates["onednn_gflops"], rates["F.linear_gflops"])
                results.append({"dtype": str(dtype).removeprefix("torch."), "layer": name, "n": n, "k": k,
                                "rows": rows, **rates, "packed_over_best_other": rates["packed_gflops"] / other})
    print(f"GFLOP/s, {args.threads} threads, best of {args.repeats} interleaved rounds")
    print("| dtype | layer | N x K | rows | packed | oneDNN | F.linear | packed / best other |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        other = max(r["onednn_gflops"], r["F.linear_gflops"])
        print(f"| {r['dtype']} | {r['layer']} | {r['n']} x {r['k']} | {r['rows']} | {r['packed_gflops']:.0f} | "
              f"{r['onednn_gflops']:.0f} | {r['F.linear_gflops']:.0f} | {r['packed_gflops'] / other:.2f}x |")
    write_record("linear", results, out=args.out, config=vars(args))


if __name__ == "__main__":
    main()
