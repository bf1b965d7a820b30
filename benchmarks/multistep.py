"""Multi-step decoding: one forward pass a step against ``num_scheduler_steps`` passes, in one process.

Every engine (one per steps value) is built first; then each round runs the same request on every
engine in turn, so a slow minute of a shared machine hits them all. Reported per engine: the median
and best decode tok/s of the rounds and the median ratio to one pass a step, round by round. The
workloads: a single greedy stream (128-token prompt, 128 output tokens, the prefill step left out
of the time, as the peers benchmark's A) and a small batch (16 prompts of 64 tokens, 64 output
tokens each, wall clock of the whole generate call). Default model (its Q4_1 weights), float32
activations. Prints a table and writes JSON.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/multistep.py [--steps 1,4,8] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_results import add_output_arg, write_record

from kvmosaic import LLM, SamplingParams
from kvmosaic.ops.cpu import isa_summary


def single_stream(llm: LLM) -> float:
    """Decode tok/s of one greedy stream, after its prefill step."""
    engine = llm.engine
    engine.add_request(None, list(range(100, 228)), SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
    engine.step()  # the prompt, and the first token
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return 127 / (time.perf_counter() - start)


def small_batch(llm: LLM) -> float:
    """Output tok/s of 16 greedy requests run to completion together."""
    prompts = [list(range(300 + 7 * i, 364 + 7 * i)) for i in range(16)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    return 16 * 64 / (time.perf_counter() - start)


WORKLOADS = {"single stream": single_stream, "16 x 64": small_batch}


def rate_summary(rates: list[float], base: list[float]) -> dict:
    """The median and best of a case's rounds and its median ratio to the base case, round by round."""
    return {"median": statistics.median(rates), "best": max(rates),
            "ratio": statistics.median(r / b for r, b in zip(rates, base, strict=True)), "rounds": rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="1,8", help="num_scheduler_steps values; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=10)
    add_output_arg(parser, "multistep")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    engines = {k: LLM(num_scheduler_steps=k, dtype="float32", enable_prefix_caching=False, kv_cache_memory="1GiB")
               for k in steps}
    rates = {(w, k): [] for w in WORKLOADS for k in steps}
    for name, run in WORKLOADS.items():
        for k in steps:
            run(engines[k])  # warm-up
        for _ in range(args.rounds):
            for k in steps:
                rates[name, k].append(run(engines[k]))
    print(f"\nhost ISA {isa_summary()}; default model (Q4_1 weights), float32, {args.rounds} interleaved rounds\n")
    print("| workload | num_scheduler_steps | median tok/s | best tok/s | median ratio to " f"{steps[0]} |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for name in WORKLOADS:
        base = rates[name, steps[0]]
        for k in steps:
            row = {"workload": name, "steps": k, **rate_summary(rates[name, k], base)}
            rows.append(row)
            print(f"| {name} | {k} | {row['median']:.1f} | {row['best']:.1f} | {row['ratio']:.3f}x |")
    write_record("multistep", rows, out=args.out, config=vars(args))


if __name__ == "__main__":
    main()
