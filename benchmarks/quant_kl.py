"""How far each quantized weight format moves the next-token distribution from the float model, per token.

For each GGUF file (q8_0 / q4_0 / q4_1 / q4_k / q6_k: the f32 GGUF of the default model quantized by
llama.cpp's quantizer, as ``ppl_oracle.py`` makes them; shipped: the default model's own Q4_1 file),
on the same token windows of the built-in evaluation corpus, each from an empty cache in one pass:
- kvmosaic, quantization "auto": the file's quantized weights, activations quantized to int8 per 32
  values (the default path) -> mean KL(float || quantized) per token and top-1 agreement against
  kvmosaic's float32 model (the f32 GGUF, quantization none);
- kvmosaic with the same weights as it holds them dequantized to float32, float activations
  (``float_activations``: the weights' own error);
- llama.cpp on the same file against llama.cpp's own f32 run (it quantizes activations too: 8 bits
  per 32 or per 256 values for its quantized dot products).
The gap between the first two is what kvmosaic's int8 activations add. Without llama.cpp (no peers
venv) its column stays empty, and formats whose file it cannot make are quantized from the default
model at load by kvmosaic, against the default model dequantized as the float model.

    bash scripts/setup_peers.sh llamacpp   # without it, kvmosaic's rows only
    python benchmarks/quant_kl.py [--formats q8_0,q4_0,q4_1,q4_k,q6_k,shipped] [--window 512]
                                  [--max-tokens 2048] [--threads 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from bench_results import write_record
from peer_runners.models import GGUF, QUANT_GGUF
from ppl_oracle import FORMATS as ORACLE_FORMATS
from ppl_oracle import add_run_args, chosen_formats, model_file

from kvmosaic.eval.corpus import EVAL_SOURCE, read_text
from kvmosaic.eval.divergence import Divergence
from kvmosaic.eval.harness import EvalModel, float_activations, load_eval_model
from kvmosaic.eval.kl import kvmosaic_divergence, llamacpp_divergence, reference_logprobs
from kvmosaic.eval.oracle import held_formats, llamacpp_missing, tensor_types
from kvmosaic.eval.ppl import tokenize_windows
from kvmosaic.model.loader import default_model_path
from kvmosaic.ops import Kernels
from kvmosaic.ops.cpu import isa_summary

FORMATS = tuple(f for f in ORACLE_FORMATS if f != "float32")
DEFAULT_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "shipped")


@dataclass(frozen=True, slots=True)
class Source:
    """Where a format's weights come from."""

    path: Path | None  # a GGUF file; None: the default model
    quantization: str | None  # what kvmosaic's loader is asked for
    made_by: str


def source(fmt: str, llamacpp: bool) -> Source:
    """The format's GGUF file when llama.cpp can make it (or it is there); without llama.cpp, the default
    model quantized to ``fmt`` at load by kvmosaic, and its own dequantized weights as the float model."""
    if fmt == "shipped":
        return Source(Path(default_model_path()), "auto", "shipped file")
    made = GGUF["float32"] if fmt == "float32" else QUANT_GGUF[fmt]
    if llamacpp or made.is_file() and GGUF["float32"].is_file():
        return Source(model_file(fmt), None if fmt == "float32" else "auto", "llama.cpp's quantizer")
    return Source(None, None if fmt == "float32" else fmt, "kvmosaic at load")


@dataclass(frozen=True, slots=True)
class KLRow:
    label: str
    source: Source
    tensor_types: str
    held: str  # how kvmosaic holds the matrices on its default path
    int8: Divergence  # quantized weights, int8 activations
    weights_only: Divergence  # the same weights dequantized, float activations
    llamacpp: Divergence | None = None  # llama.cpp on the file against its own f32 run

    def record(self) -> dict:
        return {"label": self.label, "gguf": None if self.source.path is None else self.source.path.name,
                "made_by": self.source.made_by, "tensor_types": self.tensor_types, "held": self.held,
                "num_tokens": self.int8.num_tokens, "int8": asdict(self.int8),
                "weights_only": asdict(self.weights_only),
                "llamacpp": None if self.llamacpp is None else asdict(self.llamacpp),
                "activation_kl": self.int8.mean_kl - self.weights_only.mean_kl}


def load(src: Source, window: int) -> EvalModel:
    return load_eval_model(None if src.path is None else str(src.path), "float32", window, src.quantization)


def kvmosaic_rows(formats: list[str], window: int, max_tokens: int,
                  llamacpp: bool) -> tuple[list[KLRow], list[list[int]]]:
    float_model = load(source("float32", llamacpp), window)
    windows = tokenize_windows(float_model, read_text(None, EVAL_SOURCE)[0], window, max_tokens)
    reference = reference_logprobs(float_model, windows)
    del float_model
    rows = []
    for fmt in formats:
        src = source(fmt, llamacpp)
        print(f"  {fmt:8} ...", end=" ", flush=True)
        quantized = load(src, window)
        int8 = kvmosaic_divergence(quantized, windows, reference)
        weights_only = kvmosaic_divergence(float_activations(quantized), windows, reference)
        print(f"KL int8 activations {int8.mean_kl:.5f}, float activations {weights_only.mean_kl:.5f}", flush=True)
        types = tensor_types(src.path) if src.path is not None else f"{fmt} at load"
        rows.append(KLRow(fmt, src, types, held_formats(quantized.loaded.weights), int8, weights_only))
        del quantized
    return rows, windows


def with_llamacpp(rows: list[KLRow], windows: list[list[int]], threads: int) -> tuple[list[KLRow], str]:
    paths = [r.source.path for r in rows]
    theirs, info = llamacpp_divergence(model_file("float32"), paths, windows, threads)
    return [replace(r, llamacpp=theirs[str(p)]) for r, p in zip(rows, paths, strict=True)], info


def table(rows: list[KLRow]) -> list[str]:
    def cells(d: Divergence | None) -> tuple[str, str]:
        return ("-", "-") if d is None else (f"{d.mean_kl:.5f}", f"{100 * d.top1:.2f}%")

    lines = ["| weights | kvmosaic holds | KL int8 act. | KL float act. | int8 adds | llama.cpp KL | top-1 int8 act. "
             "| top-1 float act. | llama.cpp top-1 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        (k8, t8), (kw, tw), (kl, tl) = cells(r.int8), cells(r.weights_only), cells(r.llamacpp)
        label = r.label if r.source.path is not None else f"{r.label} ({r.source.made_by})"
        lines.append(f"| {label} | {r.held} | {k8} | {kw} | {r.int8.mean_kl - r.weights_only.mean_kl:+.5f} | {kl} "
                     f"| {t8} | {tw} | {tl} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser, "quant_kl", DEFAULT_FORMATS, FORMATS, 2048)
    args = parser.parse_args()
    formats = chosen_formats(parser, args.formats, FORMATS)
    missing = llamacpp_missing()
    if missing:
        print(f"llama.cpp unavailable, its column left empty: {missing}", file=sys.stderr)
    torch.set_num_threads(args.threads)
    kernels = Kernels.load().level
    rows, windows = kvmosaic_rows(formats, args.window, args.max_tokens, missing is None)
    info = None
    if not missing:
        rows, info = with_llamacpp(rows, windows, args.threads)
    header = (f"host ISA {isa_summary()}, kvmosaic kernels {kernels}, {args.threads} threads; text {EVAL_SOURCE}, "
              f"{len(windows)} windows of {args.window} tokens, {rows[0].int8.num_tokens} scored; "
              f"KL(float || quantized) in nats per token")
    print(f"\n{header}\nllama.cpp: {info or missing}\n")
    print("\n".join(table(rows)))
    write_record("quant_kl", [r.record() for r in rows], out=args.out, config=vars(args), isa_level=kernels,
                 extra={"llamacpp_system_info": info, "llamacpp_missing": missing, "text": EVAL_SOURCE,
                        "windows": len(windows)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
