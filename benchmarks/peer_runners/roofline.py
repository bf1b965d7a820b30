"""kvmosaic's peer-benchmark results against this machine's roofline (the planner's probe).

Runs in the main venv (it imports kvmosaic's planner), called by benchmarks/peers.py.
"""

from __future__ import annotations

import dataclasses

from peer_runners.common import WEIGHT_FORMATS, WORKLOADS
from peer_runners.models import THREADS, gguf_for
from peer_runners.report import succeeded

BANDWIDTH_BUDGET_S = 1.5  # per probe; one before and one after each A run


def read_bandwidth() -> float | None:
    """This machine's read bandwidth now (bytes/s, the planner's streaming probe on THREADS threads),
    or None without the planner. A shared host's bandwidth moved between 35 and 64 GB/s within
    minutes here, so an A run is set against probes taken just before and after it, not one probe
    for the whole matrix."""
    try:
        import torch

        from kvmosaic.planner.probe import measure_read_bandwidth
    except ImportError:
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return measure_read_bandwidth(BANDWIDTH_BUDGET_S)
    finally:
        torch.set_num_threads(threads)


def weight_bytes_per_param(dtype: str, num_params: int) -> float:
    """Bytes a decode step reads per weight: a GGUF format counts its file's tensors as stored (the
    shipped Q4_1 file keeps its tied embedding / LM head in Q8_0, a third of its bytes); a float dtype
    its element size."""
    from kvmosaic.planner.roofline import dtype_bytes

    if dtype not in WEIGHT_FORMATS:
        return dtype_bytes(dtype)
    path = gguf_for(dtype)
    if not path.is_file():
        return dtype_bytes(dtype)
    from kvmosaic.model.gguf_file import GGUFFile

    return sum(t.n_bytes for t in GGUFFile(path).tensors) / num_params


def quantized_on_tiles() -> bool:
    """Whether kvmosaic's kernels here run products of many rows on q8_0 / q4_1 weights on AMX tiles
    (the weights dequantized to bf16 chunk by chunk, kvmosaic/ops/csrc/isa/amx.h), so that their rate is
    the bf16 matmul's; elsewhere float32 rows take int8 dot products, counted at the fp32 rate."""
    try:
        from kvmosaic.ops import get_ops
    except ImportError:
        return False
    ops = get_ops()
    return ops is not None and hasattr(ops, "amx_enabled") and bool(ops.amx_enabled())


def compute_dtype(dtype: str) -> str:
    """The planner's matmul precision for a run of ``dtype``."""
    if dtype == "bfloat16" or (dtype in WEIGHT_FORMATS and quantized_on_tiles()):
        return "bf16"
    return "fp32"


def roofline_rows(results: list[dict]) -> list[dict] | None:
    """kvmosaic against this machine's roofline, from the planner (kvmosaic/planner).

    A and L (the same at a 2048-token prompt): a decode step reads the weights and the KV cache once:
       their bytes / the read bandwidth probed around that run (the mean of the probes just before and
       after it), against the measured seconds per token.
    B: prefill matmul FLOPs / measured matmul FLOP/s plus 128 decode steps of 64 sequences, each the
       larger of its FLOP and weight-read times (plus KV reads), against the measured wall time.
    q8_0 / q4_1 weights count their GGUF files' bytes (scales included, tensors in the formats the file
    stores them), with float32 KV, and the matmul rate of the path their many-row products take
    (compute_dtype: bf16 on AMX tiles, else fp32).
    Attention FLOPs and activations are ignored. Returns None when the planner is not there.
    """
    try:
        from kvmosaic.planner import MODEL_PRESETS, param_count, roofline_step_time
        from kvmosaic.planner.probe import probe
    except ImportError:
        return None
    ours = [r for r in results if r["engine"] == "kvmosaic" and succeeded(r) and WORKLOADS[r["workload"]].decodes]
    if not ours:
        return []
    measured_host = probe()
    hw = measured_host.spec
    model = MODEL_PRESETS["default"]
    head = model.vocab_size * model.hidden_size  # the LM head: only sampled rows go through it
    body = param_count(model) - head * (1 if model.tie_embeddings else 2)
    rows = []
    for res in ours:
        dtype, work = res["dtype"], WORKLOADS[res["workload"]]
        compute = compute_dtype(dtype)
        rate = getattr(measured_host, compute)
        if rate.flops is None:
            rows.append({"workload": work.name, "dtype": dtype, "missing": f"no {compute} matmul figure: {rate.path}"})
            continue
        weight_size = weight_bytes_per_param(dtype, param_count(model))
        kv_size = 4 if dtype in WEIGHT_FORMATS else weight_size
        batch, context = work.num_prompts, work.prompt_len + work.max_tokens // 2
        spec = hw
        if work.single_stream_decode and res.get("read_bandwidth"):
            spec = dataclasses.replace(hw, hbm_bandwidth=res["read_bandwidth"])
        step = roofline_step_time(model, spec, batch, context, weight_size, kv_size, compute_dtype=compute)
        if work.single_stream_decode:
            roof, measured, unit = step.total_s, 1 / res["tokens_per_s"], "s/token"
        else:
            prefill = 2 * body * batch * work.prompt_len / rate.flops
            roof, measured, unit = prefill + work.max_tokens * step.total_s, res["seconds"], "s"
        rows.append({"workload": work.name, "dtype": dtype, "unit": unit, "roofline": roof,
                     "measured": measured, "efficiency": roof / measured,
                     "read_bandwidth": spec.hbm_bandwidth, "weight_bytes_per_param": weight_size,
                     "matmul_flops": rate.flops, "matmul_path": rate.path})
    return rows


def roofline_lines(rows: list[dict] | None) -> list[str]:
    """A share of the roofline only where it means one: a run faster than its roofline says the
    probe did not find this host's fastest path, so no share is printed for it."""
    from kvmosaic.planner.roofline import format_rate

    if rows is None:
        return ["roofline: planner not available"]
    if not rows:
        return ["roofline: no kvmosaic A, B or L result to compare"]
    lines = ["kvmosaic vs roofline (planner probes of this machine; A, L: weights+KV bytes / read bandwidth probed "
             "around that run, "
             "B: prefill FLOPs + 128 decode steps of 64 at max(FLOP, weight-read) time):"]
    for r in rows:
        if "missing" in r:
            lines.append(f"  {r['workload']} {r['dtype']:9} roofline n/a ({r['missing']})")
            continue
        share = (f"{100 * r['efficiency']:.0f}% of roofline" if r["efficiency"] <= 1
                 else "faster than the roofline: the probe missed a faster path, no share")
        lines.append(f"  {r['workload']} {r['dtype']:9} roofline {r['roofline']:.4g} {r['unit']}, measured "
                     f"{r['measured']:.4g} {r['unit']} -> {share} (read {r['read_bandwidth'] / 1e9:.1f} GB/s, "
                     f"matmul {format_rate(r['matmul_flops'])} on {r['matmul_path']})")
    return lines
