"""Perplexity of every KV-cache format in one table (the README's quality numbers).

The model reads ``--max-tokens`` tokens of the evaluation text (default: the Python language
reference help topics shipped with CPython, ``pydoc_data.topics``) in windows, prefilled in chunks
so that later tokens attend to quantized K/V; Oaken uses the thresholds shipped for the default
model (calibrated on different text, the stdlib module docstrings). ``--int4-groups`` adds plain
int4 rows with one scale per group of that many values, for a comparison at similar bits per value.

    HF_HUB_OFFLINE=1 nice -n 19 .venv/bin/python benchmarks/kv_quality.py
"""

from __future__ import annotations

import argparse
import json

from bench_results import add_output_arg, write_record

from kvmosaic.eval.corpus import EVAL_SOURCE, read_text
from kvmosaic.eval.harness import load_eval_model
from kvmosaic.eval.ppl import perplexity, tokenize_windows

MODES = ("auto", "int8", "int4", "oaken")


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
    for mode, group in runs:
        r = perplexity(em, windows, mode, args.chunk, args.kv_thresholds, group)
        name = mode if group is None else f"{mode} (groups of {group})"
        rows.append({"mode": name, "perplexity": r.perplexity, "mean_nll": r.mean_nll, "tokens": r.num_tokens,
                     "bits_per_value": r.bits_per_value, "folded_outliers": r.folded_outliers, "seconds": r.seconds})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["perplexity"]
    print(f"\n{source}: {rows[0]['tokens']} predicted tokens, windows of {args.window}, chunks of {args.chunk}, "
          f"dtype {args.dtype}")
    print("| kv_cache_dtype | perplexity | delta vs " + rows[0]["mode"] + " | effective bits/value |")
    print("|---|---:|---:|---:|")
    for row in rows:
        delta = 100 * (row["perplexity"] / base - 1)
        print(f"| {row['mode']} | {row['perplexity']:.4f} | {delta:+.2f}% | {row['bits_per_value']:.2f} |")
    write_record("kv_quality", rows, out=args.out, config=vars(args), extra={"text": source})


if __name__ == "__main__":
    main()
