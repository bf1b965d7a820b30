"""``kvmosaic calibrate-kv`` and ``kvmosaic eval-ppl``."""

from __future__ import annotations

import argparse
import json
import sys

from kvmosaic.eval.corpus import CALIBRATION_SOURCE, EVAL_SOURCE, read_text
from kvmosaic.quant.format import KV_CACHE_DTYPES

WEIGHT_FORMATS = ("none", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "auto")


def _add_model_args(p: argparse.ArgumentParser, text_default: str) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"], help="compute dtype")
    p.add_argument("--text", default=None, help=f"UTF-8 text file (default: the built-in {text_default})")
    p.add_argument("--threads", type=int, default=None)


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_args(p, CALIBRATION_SOURCE)
    p.add_argument("--out", default="kv_thresholds.json", help="thresholds file to write")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--outer-ratio", type=float, default=0.04, help="share of values in the outer group (both tails)")
    p.add_argument("--inner-ratio", type=float, default=0.06, help="share of values in the inner group (near zero)")
    p.add_argument("--sparse-capacity", type=int, default=None,
                   help="outlier entries per head vector (default: enough for --capacity-quantile of them)")
    p.add_argument("--capacity-quantile", type=float, default=0.99)
    p.add_argument("--no-key-rotation", dest="key_rotation", action="store_false",
                   help="store keys unrotated (default: rotated and rescaled where head_dim is a power of two)")
    p.add_argument("--key-scale-exponent", type=float, default=0.5,
                   help="key channel scales are their calibration RMS to this power (with the rotation)")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_args(p, EVAL_SOURCE)
    p.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES, action="append", dest="kv_dtypes",
                   help="KV format; repeat the option to compare several in one run")
    p.add_argument("--quantization", default=None, choices=WEIGHT_FORMATS, action="append", dest="weight_formats",
                   help="weight format: none (every weight dequantized to --dtype, the default), q8_0 / q4_0 / "
                        "q4_1 / q4_k / q6_k (quantized at load), auto (a GGUF's quantized linears kept); repeat the "
                        "option to compare several in one run")
    p.add_argument("--kv-thresholds", default=None, help="Oaken thresholds file (default: the shipped one)")
    p.add_argument("--window", type=int, default=512, help="tokens per evaluation window")
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk: later chunks attend to quantized KV")
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens of the text to evaluate")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _setup(args: argparse.Namespace, weight_format: str = "none"):
    import torch

    from kvmosaic.eval.harness import load_eval_model

    if args.threads:
        torch.set_num_threads(args.threads)
    quantization = None if weight_format == "none" else weight_format
    return load_eval_model(args.model, args.dtype, max(getattr(args, "window", 0), 4096), quantization)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvmosaic.eval.calibrate import calibrate

    text, source = read_text(args.text, CALIBRATION_SOURCE)
    em = _setup(args)
    result = calibrate(em, text, args.num_prompts, args.prompt_len, args.outer_ratio, args.inner_ratio,
                       args.sparse_capacity, args.capacity_quantile, source, args.key_rotation,
                       args.key_scale_exponent)
    result.save(args.out)
    print(f"wrote {args.out}: {result.num_prompts} prompts, sparse capacity {result.sparse_capacity} "
          f"(overflow {100 * result.overflow_rate:.2f}% of outliers)")
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from kvmosaic.eval.ppl import perplexity, tokenize_windows

    text, source = read_text(args.text, EVAL_SOURCE)
    formats = list(dict.fromkeys(args.weight_formats or ["none"]))
    kv_dtypes = list(dict.fromkeys(args.kv_dtypes or ["auto"]))
    results, windows = [], None
    for weight_format in formats:
        em = _setup(args, weight_format)
        windows = windows or tokenize_windows(em, text, args.window, args.max_tokens)  # same ids for every format
        results += [perplexity(em, windows, d, args.chunk, args.kv_thresholds) for d in kv_dtypes]
        del em
    if args.json:
        rows = [{"weight_format": r.weight_format, "kv_cache_dtype": r.kv_cache_dtype, "perplexity": r.perplexity,
                 "tokens": r.num_tokens, "bits_per_value": r.bits_per_value, "folded_outliers": r.folded_outliers,
                 "seconds": r.seconds} for r in results]
        json.dump({"text": source, "dtype": args.dtype, "window": args.window, "chunk": args.chunk,
                   "results": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"text: {source}, {results[0].num_tokens} predicted tokens, window {args.window}, chunk {args.chunk}, "
          f"compute dtype {args.dtype}")
    print("\n".join(ppl_table(results)))
    return 0


def ppl_table(results) -> list[str]:
    """One row per (weight format, KV format); "vs none": against float weights with the same KV format."""
    floats = {r.kv_cache_dtype: r.perplexity for r in results if r.weight_format == "none"}
    lines = [f"{'weights':>8} {'kv_cache_dtype':>14} {'perplexity':>11} {'vs none':>8} {'bits/value':>10} "
             f"{'seconds':>8}"]
    for r in results:
        base = floats.get(r.kv_cache_dtype)
        versus = "-" if base is None else f"{100 * (r.perplexity / base - 1):+.2f}%"
        lines.append(f"{r.weight_format:>8} {r.kv_cache_dtype:>14} {r.perplexity:11.4f} {versus:>8} "
                     f"{r.bits_per_value:10.2f} {r.seconds:8.1f}")
    return lines
