"""kvmosaic at two checkouts, side by side: the peers runner of each tree on the same workloads, in
interleaved rounds (old, new, then new, old, ...), so that a regression shows against the machine's
drift rather than against figures of another day.

    python benchmarks/trees.py --old ../kvmosaic-old [--new .] [--cases A:q4_1,C:float32] [--rounds 3]

Each tree runs its own code and its own built kernels (``PYTHONPATH`` set to the tree; build the
old one first with ``python -m kvmosaic.ops.build`` from inside it) in this interpreter's
environment. Float rows read the float32 HF directory and q8_0 rows quantize it at load, as
benchmarks/peers.py does (run it once to export the directory); q4_1 rows run the embedded Q4_1 file.
Prints a table of medians and writes JSON with every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_results import add_output_arg, git_state, write_record
from peer_runners.models import HF_DIR

from kvmosaic.ops.cpu import isa_summary

RUNNER = Path("benchmarks") / "peer_runners" / "kvmosaic_runner.py"


def run_case(tree: Path, workload: str, dtype: str, threads: int, timeout: float) -> float | str:
    """One runner process of ``tree``: tokens a second, or why there is none."""
    cmd = [sys.executable, str(tree / RUNNER), "--workload", workload, "--dtype", dtype, "--threads", str(threads)]
    if dtype != "q4_1":
        cmd += ["--model-path", str(HF_DIR)]
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree / RUNNER.parent, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timeout after {timeout:.0f} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            result = json.loads(line)
            if "tokens_per_s" in result:
                return float(result["tokens_per_s"])
            return str(result.get("error", result))
    return f"exit code {proc.returncode}: {proc.stderr.strip()[-300:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, type=Path, help="the baseline checkout")
    parser.add_argument("--new", default=Path("."), type=Path)
    parser.add_argument("--cases", default="A:float32,A:bfloat16,A:q8_0,A:q4_1,C:float32,C:bfloat16,C:q8_0,C:q4_1",
                        help="workload:dtype pairs (workloads and dtypes of benchmarks/peers.py)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    add_output_arg(parser, "trees")
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    if any(dtype != "q4_1" for _, dtype in (c.split(":") for c in args.cases.split(","))) and not HF_DIR.is_dir():
        sys.exit(f"no float32 HF directory at {HF_DIR}: run benchmarks/peers.py once to export it")
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    runs: dict[str, dict[str, list]] = {f"{w}:{d}": {"old": [], "new": []} for w, d in cases}
    for round_no in range(args.rounds):
        for workload, dtype in cases:
            order = ["old", "new"] if round_no % 2 == 0 else ["new", "old"]
            for name in order:
                value = run_case(trees[name], workload, dtype, args.threads, args.timeout)
                runs[f"{workload}:{dtype}"][name].append(value)
                shown = f"{value:.1f} tok/s" if isinstance(value, float) else value
                print(f"round {round_no + 1} {workload} {dtype:<9} {name}: {shown}", flush=True)
    rows = []
    for case, by_tree in runs.items():
        values = {name: [v for v in vs if isinstance(v, float)] for name, vs in by_tree.items()}
        medians = {name: statistics.median(vs) if vs else None for name, vs in values.items()}
        ratio = medians["new"] / medians["old"] if medians["old"] and medians["new"] else None
        rows.append({"case": case, "old": by_tree["old"], "new": by_tree["new"], "old_median": medians["old"],
                     "new_median": medians["new"], "new_over_old": ratio})
    print(f"\nhost ISA: {isa_summary()}; old {trees['old']}, new {trees['new']}; tokens a second "
          "(A: decode, C: prompt), median of the rounds")
    print("| case | old | new | new / old | rounds old | rounds new |\n|---|---:|---:|---:|---|---|")
    for row in rows:
        def fmt(x):
            return "-" if x is None else f"{x:.1f}"

        def each(vs):
            return " / ".join(fmt(v) if isinstance(v, float) else "err" for v in vs)

        ratio = "-" if row["new_over_old"] is None else f"{row['new_over_old']:.3f}"
        print(f"| {row['case']} | {fmt(row['old_median'])} | {fmt(row['new_median'])} | {ratio} | "
              f"{each(row['old'])} | {each(row['new'])} |")
    config = {**vars(args), "old": git_state(trees["old"]), "new": git_state(trees["new"])}  # commits, not paths
    write_record("trees", rows, out=args.out, config=config)


if __name__ == "__main__":
    main()
