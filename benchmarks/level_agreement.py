"""How close the kernel levels come to each other: batch invariance holds on one host and kernel
level; across levels the vector widths, the bf16 dot products and the rounding of activations differ,
so greedy text may part. For each level this host runs, the same chat prompts are generated greedily
(default model, each dtype) in a process pinned to that level (KVMOSAIC_ISA) and compared with the best
level's: the token where each prompt's text first differs, and the largest |logprob| difference of the
chosen tokens before it. Prints a table and writes JSON.

    python benchmarks/level_agreement.py [--dtypes bfloat16,float32] [--max-tokens 64] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench_results import add_output_arg, write_record

from kvmosaic.ops import available_levels

PROMPTS = ["Explain how a refrigerator works.", "Write a haiku about rain.", "List three uses of copper.",
           "What is the capital of France and why is it famous?", "Give me a short recipe for pancakes.",
           "Why is the sky blue?"]

RUN = r"""
import json, sys
from kvmosaic import LLM, SamplingParams
llm = LLM(dtype=sys.argv[1])
outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2]), logprobs=1))
print(json.dumps([[list(o.outputs[0].token_ids), [next(iter(d.values())) for d in o.outputs[0].logprobs]]
                  for o in outs]))
"""


def generate(level: str, dtype: str, max_tokens: int) -> list[tuple[list[int], list[float]]]:
    env = dict(os.environ, KVMOSAIC_ISA=level)
    done = subprocess.run([sys.executable, "-c", RUN, dtype, str(max_tokens), json.dumps(PROMPTS)],
                          capture_output=True, text=True, env=env, check=True)
    return [tuple(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]


def compare(base: list, other: list) -> dict:
    """First differing token per prompt (None: identical) and the largest |logprob| gap before it."""
    firsts, worst = [], 0.0
    for (t0, l0), (t1, l1) in zip(base, other):
        first = next((i for i, (a, b) in enumerate(zip(t0, t1)) if a != b), None)
        if first is None and len(t0) != len(t1):
            first = min(len(t0), len(t1))
        firsts.append(first)
        n = len(t0) if first is None else first
        worst = max([worst, *(abs(a - b) for a, b in zip(l0[:n], l1[:n]))])
    return {"first_difference": firsts, "identical": sum(f is None for f in firsts), "max_logprob_gap": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--max-tokens", type=int, default=64)
    add_output_arg(parser, "level_agreement")
    args = parser.parse_args()
    levels = available_levels()
    if len(levels) < 2:
        sys.exit(f"only {levels} built: build the others with python -m kvmosaic.ops.build --levels all")
    rows = []
    for dtype in args.dtypes.split(","):
        runs = {level: generate(level, dtype, args.max_tokens) for level in levels}
        for level in levels[1:]:
            row = {"dtype": dtype, "level": level, "against": levels[0], "prompts": len(PROMPTS),
                   **compare(runs[levels[0]], runs[level])}
            rows.append(row)
            print(f"{dtype:9} {level:12} vs {levels[0]}: {row['identical']}/{len(PROMPTS)} identical, first "
                  f"differences {row['first_difference']}, max |logprob gap| before them {row['max_logprob_gap']:.3g}")
    write_record("level_agreement", rows, out=args.out, config=vars(args))


if __name__ == "__main__":
    main()
