"""The decode team's barrier: its own (per-thread arrival counters) against OpenMP's, in one process.

A single-stream decode step runs every layer in one team of threads with ~9 barriers a layer
(kvmosaic/ops/csrc/team/team.h); ``KVMOSAIC_TEAM_BARRIER=omp`` switches a step to OpenMP's barrier, and
the variable is read at every step, so the rounds here alternate the two kinds on the same engines.
Workloads as benchmarks/multistep.py (a greedy stream, a 16 x 64 batch), with 1 and 8 scheduler
steps; default model (its Q4_1 weights), float32 activations. Reported: the median and best tok/s of
the rounds and the median ratio to OpenMP's, round by round. Prints a table and writes JSON.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/team_barrier.py [--steps 1,8] [--rounds 12]
"""

from __future__ import annotations

import argparse
import os

from bench_results import add_output_arg, write_record
from multistep import WORKLOADS, rate_summary

from kvmosaic import LLM
from kvmosaic.ops.cpu import isa_summary

KINDS = {"omp": "omp", "own": "own"}  # KVMOSAIC_TEAM_BARRIER values; anything but omp is the team's own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="1,8", help="num_scheduler_steps values")
    parser.add_argument("--rounds", type=int, default=12)
    add_output_arg(parser, "team_barrier")
    args = parser.parse_args()
    if os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive":
        raise SystemExit("OMP_WAIT_POLICY=passive forces OpenMP's barrier: unset it to compare the two")
    steps = [int(s) for s in args.steps.split(",")]
    engines = {k: LLM(num_scheduler_steps=k, dtype="float32", enable_prefix_caching=False, kv_cache_memory="1GiB")
               for k in steps}
    rates = {(w, k, kind): [] for w in WORKLOADS for k in steps for kind in KINDS}
    try:
        for name, run in WORKLOADS.items():
            for k in steps:
                run(engines[k])  # warm-up
            for _ in range(args.rounds):
                for k in steps:
                    for kind, value in KINDS.items():
                        os.environ["KVMOSAIC_TEAM_BARRIER"] = value
                        rates[name, k, kind].append(run(engines[k]))
    finally:
        os.environ.pop("KVMOSAIC_TEAM_BARRIER", None)
    print(f"\nhost ISA {isa_summary()}; default model (Q4_1 weights), float32, {args.rounds} interleaved rounds\n")
    print("| workload | scheduler steps | barrier | median tok/s | best tok/s | median ratio own / omp |")
    print("|---|---:|---|---:|---:|---:|")
    rows = []
    for name in WORKLOADS:
        for k in steps:
            base = rates[name, k, "omp"]
            for kind in KINDS:
                row = {"workload": name, "steps": k, "barrier": kind, **rate_summary(rates[name, k, kind], base)}
                rows.append(row)
                print(f"| {name} | {k} | {kind} | {row['median']:.1f} | {row['best']:.1f} | {row['ratio']:.3f}x |")
    write_record("team_barrier", rows, out=args.out, config=vars(args))


if __name__ == "__main__":
    main()
