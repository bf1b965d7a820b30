"""Perplexity of every KV-cache format in one table (the README's quality numbers).

The model reads ``--max-tokens`` tokens of the evaluation text (default: the Python language
reference help topics shipped with CPython, ``pydoc_data.topics``) in windows, prefilled in chunks
so that later tokens attend to quantized K/V; Oaken uses the thresholds shipped for the default
model (calibrated on different text, the stdlib module docstrings). ``--int4-groups`` adds plain
int4 rows with one scale per group of that many values, for a comparison at similar bits per value.

Next to each perplexity: its cost over the first mode's (the float cache) with the standard error of
that cost from the paired per-token differences, and the mean KL divergence per token from the first
mode's next-token distributions. The perplexity cost of one format moves by a few tenths of a point
with small changes (thresholds, float rounding elsewhere) because it is an average of large per-token
changes of both signs; the KL is positive at every token and far steadier, so compare formats by it.

    HF_HUB_OFFLINE=1 nice -n 19 .venv/bin/python benchmarks/kv_quality.py
"""

from __future__ import annotations

import argparse
import json

from bench_results import add_output_arg, write_record

from kvmosaic.eval.corpus import EVAL_SOURCE, read_text
from kvmosaic.eval.harness import load_eval_model
from kvmosaic.eval.paired import AgainstFirst, paired_cost
from kvmosaic.eval.ppl import perplexity, tokenize_windows

MODES = ("auto", "bf16", "int8", "int4", "oaken")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--text", default=None, help=f"text file (default: {EVAL_SOURCE})")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--kv-thresholds", default=None)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--int4-groups", nargs="*", type=int, default=[32, 16],
                        help="extra int4 rows, one scale per this many values")
    add_output_arg(parser, "kv_quality")
    args = parser.parse_args()
    text, source = read_text(args.text, EVAL_SOURCE)
    em = load_eval_model(args.model, args.dtype)
    windows = tokenize_windows(em, text, args.window, args.max_tokens)
    rows = []
    runs = [(mode, None) for mode in args.modes] + [("int4", g) for g in args.int4_groups]
    against, base_nll = AgainstFirst(), None
    for mode, group in runs:
        first = base_nll is None
        r = perplexity(em, windows, mode, args.chunk, args.kv_thresholds, group,
                       on_logprobs=against.keep if first else against.compare)
        name = mode if group is None else f"{mode} (groups of {group})"
        row = {"mode": name, "perplexity": r.perplexity, "mean_nll": r.mean_nll, "tokens": r.num_tokens,
               "bits_per_value": r.bits_per_value, "folded_outliers": r.folded_outliers, "seconds": r.seconds}
        if first:
            base_nll = r.token_nll
        else:
            cost, stderr = paired_cost(r.token_nll, base_nll)
            div = against.take()
            row |= {"cost_pct": cost, "cost_stderr_pts": stderr, "mean_kl": div.mean_kl, "p99_kl": div.p99_kl,
                    "top1": div.top1}
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{source}: {rows[0]['tokens']} predicted tokens, windows of {args.window}, chunks of {args.chunk}, "
          f"dtype {args.dtype}")
    print("| kv_cache_dtype | perplexity | cost vs " + rows[0]["mode"] + " (+- 1 s.e.) | KL nats/token | "
          "top-1 same | effective bits/value |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        if "cost_pct" in row:
            cost = f"{row['cost_pct']:+.2f}% +- {row['cost_stderr_pts']:.2f}"
            kl, top1 = f"{row['mean_kl']:.5f}", f"{100 * row['top1']:.2f}%"
        else:
            cost, kl, top1 = "", "", ""
        print(f"| {row['mode']} | {row['perplexity']:.4f} | {cost} | {kl} | {top1} | {row['bits_per_value']:.2f} |")
    write_record("kv_quality", rows, out=args.out, config=vars(args), extra={"text": source})


if __name__ == "__main__":
    main()
