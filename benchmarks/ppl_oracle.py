"""kvmosaic's perplexity of each weight format against llama.cpp's own, on the same GGUF files.

For every format the same GGUF file goes to both engines: float32 (the f32 GGUF exported from the
default model), q8_0 / q4_0 / q4_1 / q4_k / q6_k (that file quantized by llama.cpp's quantizer,
"pure": every matrix in the format where its rows allow), q4_k_m (llama.cpp's own mix) and "shipped"
(the embedded model's own Q4_1 file, Q8_0 embeddings). kvmosaic loads each file with --quantization
(default "auto": quantized linears kept as they are, types without a kernel held as Q8_0; "none":
dequantized to float32). The same token windows of the built-in
evaluation corpus go to both, each from an empty cache, every position 1..n-1 scored, float32 KV
in both (kvmosaic/eval/oracle.py). The engines must agree within 1% per format.

    bash scripts/setup_peers.sh llamacpp
    python benchmarks/ppl_oracle.py [--formats float32,q8_0,q4_0,q4_1,q4_k,q6_k,q4_k_m,shipped] [--window 512]
                                    [--max-tokens 4096] [--quantization auto] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from bench_results import add_output_arg, write_record
from peer_runners.models import GGUF, PEERS, QUANT_FORMATS, prepare_gguf, prepare_hf_dir, prepare_quantized_gguf

from kvmosaic.eval.corpus import EVAL_SOURCE, read_text
from kvmosaic.eval.harness import load_eval_model
from kvmosaic.eval.oracle import AGREEMENT, OracleRow, compare, llamacpp_missing
from kvmosaic.eval.ppl import tokenize_windows
from kvmosaic.model.loader import default_model_path
from kvmosaic.ops import Kernels
from kvmosaic.ops.cpu import isa_summary

FORMATS = ("float32", *QUANT_FORMATS, "shipped")


def model_file(fmt: str) -> Path:
    """The GGUF file of a format, made on first use."""
    if fmt == "shipped":
        return Path(default_model_path())
    python = PEERS / "llamacpp-venv" / "bin" / "python"
    prepare_hf_dir()
    prepare_gguf(python)
    return GGUF["float32"] if fmt == "float32" else prepare_quantized_gguf(python, fmt)


def add_run_args(parser: argparse.ArgumentParser, bench: str, default: tuple[str, ...], choices: tuple[str, ...],
                 max_tokens: int) -> None:
    """The flags of a run over formats and token windows (this script's and quant_kl.py's)."""
    parser.add_argument("--formats", default=",".join(default), help=f"comma-separated, from {', '.join(choices)}")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--threads", type=int, default=2)
    add_output_arg(parser, bench)


def chosen_formats(parser: argparse.ArgumentParser, formats: str, choices: tuple[str, ...]) -> list[str]:
    chosen = formats.split(",")
    if unknown := set(chosen) - set(choices):
        parser.error(f"unknown formats {sorted(unknown)}; choose from {', '.join(choices)}")
    return chosen


def run(formats: list[str], quantization: str | None, window: int, max_tokens: int,
        threads: int) -> tuple[list[OracleRow], list[list[int]]]:
    text, _ = read_text(None, EVAL_SOURCE)
    rows, windows = [], None
    for fmt in formats:
        path = model_file(fmt)
        em = load_eval_model(str(path), "float32", window, None if fmt == "float32" else quantization)
        windows = windows or tokenize_windows(em, text, window, max_tokens)  # one tokenizer for every file
        print(f"  {fmt:8} ...", end=" ", flush=True)
        row = compare(fmt, path, em, windows, threads)
        print(f"kvmosaic {row.kvmosaic:.4f}, llama.cpp {row.llamacpp:.4f} ({100 * row.difference:+.2f}%)", flush=True)
        rows.append(row)
        del em
    return rows, windows


def table(rows: list[OracleRow]) -> list[str]:
    lines = ["| weights | GGUF matrices | kvmosaic loads as | kvmosaic holds | kvmosaic PPL | llama.cpp PPL "
             "| difference | within 1% |", "|---|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.label} | {r.tensor_types} | {r.weight_format} | {r.held} | {r.kvmosaic:.4f} | "
                     f"{r.llamacpp:.4f} | {100 * r.difference:+.2f}% | {'yes' if r.agrees else 'NO'} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="auto", choices=["auto", "none"],
                        help="how kvmosaic loads the quantized files (float32 always loads as none)")
    add_run_args(parser, "ppl_oracle", FORMATS, FORMATS, 4096)
    args = parser.parse_args()
    formats = chosen_formats(parser, args.formats, FORMATS)
    if missing := llamacpp_missing():
        print(f"llama.cpp oracle unavailable: {missing}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    kernels = Kernels.load().level
    rows, windows = run(formats, None if args.quantization == "none" else args.quantization, args.window,
                        args.max_tokens, args.threads)
    info = rows[0].llamacpp_info
    header = (f"host ISA {isa_summary()}, kvmosaic kernels {kernels}, {args.threads} threads; text {EVAL_SOURCE}, "
              f"{len(windows)} windows of {args.window} tokens, {rows[0].num_tokens} scored")
    lines = table(rows)
    print(f"\n{header}\nllama.cpp: {info}\n")
    print("\n".join(lines))
    ok = all(r.agrees for r in rows)
    print(f"\nall formats within {100 * AGREEMENT:.0f}%: {'yes' if ok else 'NO'}")
    write_record("ppl_oracle", [{**asdict(r), "difference": r.difference, "agrees": r.agrees} for r in rows],
                 out=args.out, config=vars(args), isa_level=kernels,
                 extra={"llamacpp_system_info": info, "text": EVAL_SOURCE, "windows": len(windows), "all_agree": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
