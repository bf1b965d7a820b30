"""Quantized linears of the default model: ``ops.quantized_linear`` against the packed float kernel.

For every projection shape of SmolLM2-135M and a few row counts: microseconds per call and the
weight bytes streamed per second, for Q8_0, Q4_1 and Q4_K weights next to the packed float weight of
the activations' dtype, best of a few repeats, interleaved in one run. Decode rows take the int8 dot
products; where the kernels have AMX tiles (Intel), products of ``ops.AMX_MIN_ROWS`` rows or more run
on the tiles with the weights dequantized to bf16, and each format also gets an "int8" column with
the tiles switched off (the same rows, the path every other CPU runs). Prints a table and writes JSON.

With ``--gguf FILE`` it profiles one decode row over a real model file instead: every matrix kind a
token reads (each as the loader holds it: fused q/k/v, a composite when v's type differs from q's,
each of its parts timed as a kind of its own; fused gate/up; o; down; the LM head), the kernel's
weight GB/s on the real shape cold (a set of copies at least 4x the last-level cache, called in turn,
so the weights come from DRAM) and hot (a slice of about 4 MiB called again and again, so it sits in
cache), at each thread count, against the DRAM read probe at that thread count; and the milliseconds
a token spends in each kind at the cold rate. A kind whose hot GB/s is not well above the probe's is
bound by its arithmetic, not by memory.

    .venv/bin/python benchmarks/qlinear.py [--rows 1,4,64,512] [--dtype float32] [--threads 2] [--level avx2]
                                           [--out PATH]
    .venv/bin/python benchmarks/qlinear.py --gguf model-q4_k_m.gguf [--threads 1,2] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter

import torch
from bench_results import add_output_arg, write_record
from linear import SHAPES, time_call

from kvmosaic.ops import Kernels
from kvmosaic.ops.cpu import isa_summary
from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw
from kvmosaic.quant.composite import CompositeWeight

FORMATS = ("q8_0", "q4_1", "q4_k")


def tile_modes(ops) -> list[bool]:
    """The AMX switch positions to measure: on and off where the tiles exist, else only off."""
    return [True, False] if ops.amx_supported() else [False]


def measure(ops, n: int, k: int, rows: int, dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """Column -> (microseconds per call, GB/s of weight bytes)."""
    w = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k).to(dtype)
    results = {}
    packed = ops.pack_linear_weight(w.to(dtype))
    seconds = min(time_call(lambda: ops.packed_linear(x, packed)) for _ in range(3))
    results[str(dtype).removeprefix("torch.")] = (seconds * 1e6, packed.nbytes / seconds / 1e9)
    before = ops.amx_enabled()
    try:
        for fmt in FORMATS:
            q = qi.interleave(qw.quantize(w, fmt))
            best = {tiles: float("inf") for tiles in tile_modes(ops)}
            for _ in range(3):  # the switch positions alternate within the repeats
                for tiles in best:
                    ops.set_amx(tiles)
                    seconds = time_call(lambda q=q: ops.quantized_linear(x, q.codes, q.scale, q.extra))
                    best[tiles] = min(best[tiles], seconds)
            for tiles, seconds in best.items():
                name = fmt if tiles or len(best) == 1 else f"{fmt} int8"
                results[name] = (seconds * 1e6, q.nbytes / seconds / 1e9)
    finally:
        ops.set_amx(before)
    return results


# ------------------------------------------------------------------ --gguf: a real model's decode row
HOT_BYTES = 4 << 20  # a slice that stays in cache between calls
GGUF_LAYER_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
                    "down": ("ffn_down",)}


def _layer_weight(tensors: dict, layer: int, parts: tuple[str, ...]) -> qw.QuantizedWeight | CompositeWeight:
    """The loader's weight for a layer product: its parts' matrices fused as concat_rows fuses them."""
    found = [tensors[f"blk.{layer}.{p}.weight"] for p in parts]
    return qw.concat_rows([qw.from_gguf(t.data, qw.Q(t.tensor_type)) for t in found])


def gguf_kinds(path: str) -> tuple[dict[str, qi.InterleavedWeight], Counter]:
    """A real file's matrix kinds one decode token reads: name -> one interleaved weight of that kind,
    and name -> how many such products a token runs. The name says the product and its kernel kind."""
    from kvmosaic.model.gguf_file import GGUFFile
    tensors = {t.name: t for t in GGUFFile(path).tensors}
    layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    kinds: dict[str, qi.InterleavedWeight] = {}
    count: Counter = Counter()
    names: dict[str, list[str]] = {}  # a product's name -> its parts' names (a composite's parts each)
    for layer in range(layers):
        for product, parts in GGUF_LAYER_PARTS.items():
            types = "+".join(dict.fromkeys(qw.Q(tensors[f"blk.{layer}.{p}.weight"].tensor_type).name for p in parts))
            name = f"{product} {types}"
            if name not in names:
                w = qi.interleave(_layer_weight(tensors, layer, parts))
                pieces = w.parts if isinstance(w, CompositeWeight) else (w,)
                names[name] = [name if len(pieces) == 1 else f"{name} [{p.source}]" for p in pieces]
                kinds.update(zip(names[name], pieces, strict=True))
            count.update(names[name])
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    name = f"lm_head {qw.Q(head.tensor_type).name}"
    kinds[name], count[name] = qi.interleave(qw.from_gguf(head.data, qw.Q(head.tensor_type))), 1
    return kinds, count


def _groups(w: qi.InterleavedWeight, groups: int) -> qi.InterleavedWeight:
    """The first ``groups`` 16-column groups of a weight (a valid weight of fewer output columns)."""
    cut = lambda t: None if t is None else t[:groups].contiguous()
    return qi.InterleavedWeight(cut(w.codes), cut(w.scale), cut(w.min), w.source, cut(w.super_scale))


def _seconds_per_call(ops, weights: list[qi.InterleavedWeight], x: torch.Tensor, budget_s: float) -> float:
    """Best over rounds of the mean time of one call, the weights called in turn."""
    call = lambda w: ops.quantized_linear(x, w.codes, w.scale, w.extra)
    for w in weights:
        call(w)
    best, deadline = math.inf, time.perf_counter() + budget_s
    while time.perf_counter() < deadline or best == math.inf:
        start = time.perf_counter()
        for w in weights:
            call(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def kind_rates(ops, w: qi.InterleavedWeight, dtype: torch.dtype, cold_bytes: int) -> dict[str, float]:
    """GB/s of weight bytes for one decode row: cold (copies >= cold_bytes in turn) and hot (a cached slice)."""
    n, k = w.shape
    x = torch.randn(1, k).to(dtype)
    copies = [w] + [w.placed(torch.clone) for _ in range(math.ceil(cold_bytes / w.nbytes) - 1)]
    cold = _seconds_per_call(ops, copies, x, 0.6)
    del copies
    groups = max(1, min(n // qi.COLUMNS, HOT_BYTES * (n // qi.COLUMNS) // w.nbytes))
    hot_w = _groups(w, groups)
    hot = _seconds_per_call(ops, [hot_w], x, 0.3)
    return {"cold_gb_s": w.nbytes / cold / 1e9, "hot_gb_s": hot_w.nbytes / hot / 1e9, "cold_us": cold * 1e6}


def gguf_profile(ops, args, dtype: torch.dtype) -> list[dict]:
    from kvmosaic.planner.caches import dram_probe_bytes, last_level_cache
    from kvmosaic.planner.probe import measure_read_bandwidth
    cold_bytes = dram_probe_bytes(last_level_cache())
    kinds, count = gguf_kinds(args.gguf)
    rows = []
    for threads in (int(t) for t in str(args.threads).split(",")):
        torch.set_num_threads(threads)
        dram = measure_read_bandwidth(1.0) / 1e9
        print(f"{threads} threads: DRAM read probe {dram:.1f} GB/s ({cold_bytes >> 20} MiB); one {args.dtype} row")
        print(f"{'product kind (held as)':28s} {'shape':>14s} {'MB':>7s} {'bits/w':>6s} {'per tok':>7s} "
              f"{'cold GB/s':>9s} {'hot GB/s':>9s} {'cold/DRAM':>9s} {'ms/token':>8s}")
        total_ms = total_mb = 0.0
        for name, w in kinds.items():
            rate = kind_rates(ops, w, dtype, cold_bytes)
            ms = count[name] * rate["cold_us"] / 1e3
            total_ms, total_mb = total_ms + ms, total_mb + count[name] * w.nbytes / 1e6
            n, k = w.shape
            bits = w.nbytes * 8 / (n * k)  # what the kernel reads per weight, as held (q4k: 4.625)
            print(f"{f'{name} ({w.kind})':28s} {f'{n}x{k}':>14s} {w.nbytes / 1e6:7.2f} {bits:6.3f} {count[name]:7d} "
                  f"{rate['cold_gb_s']:9.1f} {rate['hot_gb_s']:9.1f} {rate['cold_gb_s'] / dram:9.2f} {ms:8.2f}",
                  flush=True)
            rows.append({"threads": threads, "kind": name, "held": w.kind, "n": n, "k": k, "bytes": w.nbytes,
                         "bits_per_weight": bits, "per_token": count[name], "dram_gb_s": dram, **rate,
                         "ms_per_token": ms})
        print(f"{'all products':28s} {'':>14s} {total_mb:7.1f} {'':>6s} {'':>7s} {total_mb / total_ms:9.1f} {'':>9s} "
              f"{total_mb / total_ms / dram:9.2f} {total_ms:8.2f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,64")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="activations")
    parser.add_argument("--threads", default="2", help="threads (--gguf: a comma list)")
    parser.add_argument("--level", default=None, help="kernel level (default: the best built)")
    parser.add_argument("--gguf", default=None, help="profile one decode row over this model file's matrix kinds")
    add_output_arg(parser, "qlinear")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernels = Kernels.load(level=args.level)
    if not kernels.has("quantized_linear"):
        raise SystemExit("the C++ kernels are not built: python -m kvmosaic.ops.build")
    ops = kernels.ops
    if args.gguf is not None:
        print(f"host ISA: {isa_summary()}; level {kernels.level}; {args.gguf}")
        rows = gguf_profile(ops, args, dtype)
        write_record("qlinear-gguf", rows, out=args.out, config=vars(args), isa_level=kernels.level)
        return
    torch.set_num_threads(int(args.threads))
    tiles = f"AMX tiles from {ops.AMX_MIN_ROWS} rows" if ops.amx_supported() else "no AMX tiles"
    print(f"host ISA: {isa_summary()}; level {kernels.level}, {tiles}, {args.threads} threads, {args.dtype} "
          "activations; us per call (weight GB/s)")
    rows_out, header = [], False
    for name, (n, k) in SHAPES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            result = measure(kernels.ops, n, k, rows, dtype)
            if not header:
                print(f"{'shape':8s} {'rows':>5s} " + " ".join(f"{c:>18s}" for c in result))
                header = True
            cells = " ".join(f"{us:9.1f} ({gbs:5.1f})" for us, gbs in result.values())
            print(f"{name:8s} {rows:5d} {cells}", flush=True)
            cells_json = {c: {"us": us, "gb_s": gbs} for c, (us, gbs) in result.items()}
            rows_out.append({"shape": name, "rows": rows, **cells_json})
    write_record("qlinear", rows_out, out=args.out, config=vars(args), isa_level=kernels.level)


if __name__ == "__main__":
    main()
