"""``kvmosaic plan``: the roofline capacity planner as a table (or JSON) per batch size."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from kvmosaic.planner import roofline as rl
from kvmosaic.planner.presets import HARDWARE_PRESETS, MODEL_PRESETS, resolve_hardware, resolve_model

GB = 1e9  # the book's memory figures are decimal gigabytes
DEFAULT_BATCH_SIZES = "1,8,16,32,64,240"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help=f"preset ({', '.join(MODEL_PRESETS)}) or an HF config.json / model directory")
    p.add_argument("--hardware", default="tpu-v5e", choices=sorted(HARDWARE_PRESETS))
    p.add_argument("--probe", action="store_true", help="measure this machine instead of a hardware preset")
    p.add_argument("--probe-seconds", type=float, default=3.0)
    p.add_argument("--chips", type=int, default=1)
    p.add_argument("--weight-dtype", default="bf16", help=f"one of {', '.join(rl.DTYPE_BYTES)}")
    p.add_argument("--kv-dtype", default="bf16")
    p.add_argument("--compute-dtype", default=None, help="matmul dtype (default: fp32 for fp32 weights, else bf16)")
    p.add_argument("--context-len", type=int, default=8192, help="cached tokens per sequence")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES)
    p.add_argument("--num-params", type=float, default=None, help="override the parameter count (e.g. 13e9)")
    p.add_argument("--kv-bytes-per-token", type=float, default=None, help="override the model's KV bytes/token")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from exc
    if not sizes or min(sizes) < 1:
        raise ValueError("--batch-sizes needs at least one batch size, all >= 1")
    return sizes


def _hardware(args: argparse.Namespace) -> tuple[rl.HardwareSpec, str | None]:
    """The hardware spec and, for a probe, a line saying what was measured and how."""
    if args.probe:
        from kvmosaic.planner.probe import probe  # imports torch only when asked

        measured = probe(args.probe_seconds)
        return measured.spec, measured.describe()
    return resolve_hardware(args.hardware), None


def _workload(model: rl.ModelSpec, args: argparse.Namespace) -> rl.Workload:
    weight_bytes_per_param = rl.dtype_bytes(args.weight_dtype)
    work = rl.workload(model, weight_bytes_per_param, rl.dtype_bytes(args.kv_dtype))
    if args.num_params is not None:
        work = replace(work, num_params=args.num_params, weight_bytes=args.num_params * weight_bytes_per_param)
    if args.kv_bytes_per_token is not None:
        work = replace(work, kv_bytes_per_token=args.kv_bytes_per_token)
    return work


def build_report(args: argparse.Namespace, hardware: rl.HardwareSpec, probe_note: str | None = None) -> dict:
    """Everything the planner prints, as plain data (bytes, seconds)."""
    if args.chips < 1 or args.context_len < 1:
        raise ValueError("--chips and --context-len must be >= 1")
    model = resolve_model(args.model)
    work = _workload(model, args)
    weight_dtype = rl.canonical_dtype(args.weight_dtype)
    compute = rl.canonical_dtype(args.compute_dtype or rl.default_compute_dtype(rl.dtype_bytes(weight_dtype)))
    rows = rl.plan(work, hardware, args.context_len, parse_batch_sizes(args.batch_sizes), compute, args.chips)
    return {
        "model": model.name, "num_params": work.num_params, "weight_bytes": work.weight_bytes,
        "kv_bytes_per_token": work.kv_bytes_per_token,
        "weight_dtype": weight_dtype, "kv_dtype": rl.canonical_dtype(args.kv_dtype), "compute_dtype": compute,
        "hardware": hardware.name, "chips": args.chips, "hbm_bytes_per_chip": hardware.hbm_bytes,
        "hbm_bandwidth_per_chip": hardware.hbm_bandwidth, "flops_per_chip": hardware.flops(compute),
        "context_len": args.context_len, "probe": probe_note,
        "critical_batch_size": rl.critical_batch_size(hardware, rl.dtype_bytes(weight_dtype), compute),
        "max_batch_size": rl.max_batch_size(work, hardware, args.context_len, args.chips),
        "rows": [_row_dict(row) for row in rows],
    }


def _row_dict(row: rl.PlanRow) -> dict:
    return {
        "batch": row.batch, "kv_cache_bytes": row.kv_cache_bytes, "total_bytes": row.total_bytes,
        "fits": row.fits, "step_s": row.step.total_s, "kv_load_s": row.step.kv_load_s,
        "weight_load_s": row.step.weight_load_s, "matmul_flops_s": row.step.matmul_flops_s,
        "mlp_bound": "compute" if row.step.compute_bound else "memory", "tokens_per_s": row.tokens_per_s,
    }


def format_report(r: dict) -> str:
    chips = r["chips"]
    lines = [
        f"{r['model']}: {r['num_params'] / 1e9:.2f}e9 params, {r['weight_bytes'] / GB:.2f} GB of {r['weight_dtype']} "
        f"weights; KV {r['kv_bytes_per_token'] / 1e3:.1f} kB/token in {r['kv_dtype']}, "
        f"{r['context_len'] * r['kv_bytes_per_token'] / GB:.2f} GB per {r['context_len']}-token sequence",
        f"{chips} x {r['hardware']}: {chips * r['hbm_bytes_per_chip'] / GB:.2f} GB memory, "
        f"{chips * r['hbm_bandwidth_per_chip'] / 1e12:.3g} TB/s, "
        f"{rl.format_rate(chips * r['flops_per_chip'])} {r['compute_dtype']}",
        f"critical batch size {r['critical_batch_size']:.0f} ({r['weight_dtype']} weights, {r['compute_dtype']} "
        f"compute); largest batch that fits: {r['max_batch_size']}",
        "",
        f"{'batch':>6} {'KV cache GB':>12} {'total GB':>10} {'fits':>5} {'step ms':>9} {'KV load ms':>11} "
        f"{'MLP ms':>8} {'MLP bound':>10} {'tokens/s':>11}",
    ]
    for row in r["rows"]:
        mlp_ms = 1e3 * max(row["weight_load_s"], row["matmul_flops_s"])
        lines.append(
            f"{row['batch']:>6} {row['kv_cache_bytes'] / GB:>12.2f} {row['total_bytes'] / GB:>10.2f} "
            f"{'yes' if row['fits'] else 'no':>5} {1e3 * row['step_s']:>9.2f} {1e3 * row['kv_load_s']:>11.2f} "
            f"{mlp_ms:>8.2f} {row['mlp_bound']:>10} {row['tokens_per_s']:>11.2f}"
        )
    lines.append("GB = 1e9 bytes; step time = KV load (bandwidth-bound) + max(weight load, matmul FLOPs)")
    if r.get("probe"):
        lines.insert(2, r["probe"])
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    report = build_report(args, *_hardware(args))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
