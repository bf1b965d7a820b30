"""Peer-benchmark results against this machine's roofline (the planner's probe).

A and L (one sequence decoding): every engine's run gets its share of the DRAM read roofline, the
bytes a decode step must read (weights, KV cache) over the seconds per token times the read bandwidth
probed around that run, with a buffer at least 4x the last-level cache on all usable cores. kvmosaic's
A, B and L runs are also set against the planner's step-time model. Runs in the main venv (it imports
kvmosaic's planner), called by benchmarks/peers.py.
"""

from __future__ import annotations

import dataclasses

from peer_runners.common import WEIGHT_FORMATS, WORKLOADS
from peer_runners.footprint import kv_element_bytes
from peer_runners.report import succeeded

BANDWIDTH_BUDGET_S = 1.5  # per probe; one before and one after each A run


def read_bandwidth() -> float | None:
    """This machine's DRAM read bandwidth now (bytes/s, the planner's streaming probe on all usable cores
    over a buffer at least 4x the last-level cache), or None without the planner. A shared host's
    bandwidth moved between 35 and 64 GB/s within minutes here, so an A run is set against probes
    taken just before and after it, not one probe for the whole matrix."""
    try:
        from kvmosaic.planner.probe import all_threads, measure_read_bandwidth
    except ImportError:
        return None
    with all_threads():
        return measure_read_bandwidth(BANDWIDTH_BUDGET_S)


def read_probe_setup() -> str:
    """The probe's buffer and the cache it must miss: "256 MiB buffer, LLC L3 32 MiB, 2 threads"."""
    try:
        from kvmosaic.planner.caches import MiB, dram_probe_bytes, last_level_cache
        from kvmosaic.planner.probe import usable_cpus
    except ImportError:
        return "planner not available"
    llc = last_level_cache()
    return (f"{dram_probe_bytes(llc) / MiB:.0f} MiB buffer, LLC {llc.describe() if llc else 'not listed in sysfs'}, "
            f"{usable_cpus()} threads")


def decode_share(read_bytes_per_token: float, seconds_per_token: float, bandwidth: float) -> float:
    """Share of the read roofline a decode reached: the time the bytes take at ``bandwidth`` over the
    time it took."""
    if min(read_bytes_per_token, seconds_per_token, bandwidth) <= 0:
        raise ValueError("bytes, seconds and bandwidth must be positive")
    return read_bytes_per_token / (seconds_per_token * bandwidth)


def decode_share_rows(results: list[dict], model) -> list[dict]:
    """Every engine's A / L run with a bandwidth probe and known weight bytes: its share of the read
    roofline. The bytes a step reads: the weights (an untied embedding table is only indexed) plus
    the KV cache at the run's mean context, in the engine's cache dtype (kv_element_bytes)."""
    from kvmosaic.planner.roofline import kv_bytes_per_token

    rows = []
    for res in results:
        work = WORKLOADS[res["workload"]]
        if not (work.single_stream_decode and succeeded(res) and res.get("read_bandwidth")
                and res.get("weights_read_bytes")):
            continue
        context = work.prompt_len + work.max_tokens / 2
        kv = context * kv_bytes_per_token(model, kv_element_bytes(res["engine"], res["dtype"]))
        seconds = 1 / res["tokens_per_s"]
        rows.append({"workload": work.name, "dtype": res["dtype"], "engine": res["engine"],
                     "weights_bytes": res["weights_read_bytes"], "kv_bytes": kv, "seconds_per_token": seconds,
                     "read_bandwidth": res["read_bandwidth"],
                     "share": decode_share(res["weights_read_bytes"] + kv, seconds, res["read_bandwidth"])})
    return rows


def decode_share_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["share of the DRAM read roofline, A and L (weights + KV bytes per token / (s per token x read "
             "bandwidth probed around the run)):"]
    for r in sorted(rows, key=lambda r: (r["workload"], r["dtype"], r["engine"])):
        lines.append(f"  {r['workload']} {r['dtype']:9} {r['engine']:9} {100 * r['share']:.0f}% "
                     f"({(r['weights_bytes'] + r['kv_bytes']) / 1e6:.0f} MB per token at "
                     f"{r['read_bandwidth'] / 1e9:.1f} GB/s, {1e3 * r['seconds_per_token']:.1f} ms per token)")
    return lines


def weight_bytes_per_param(res: dict, num_params: int) -> float:
    """Bytes a decode step reads per weight: the run's model file as stored where it is known (the
    shipped Q4_1 file keeps its tied embedding / LM head in Q8_0, a third of its bytes), else the
    dtype's element size."""
    from kvmosaic.planner.roofline import dtype_bytes

    if res.get("weights_bytes"):
        return res["weights_bytes"] / num_params
    return dtype_bytes("q4_k" if res["dtype"] == "q4_k_m" else res["dtype"])  # q4_k_m: mostly Q4_K


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


def roofline_rows(results: list[dict], model) -> list[dict] | None:
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
        from kvmosaic.planner import param_count, roofline_step_time
        from kvmosaic.planner.probe import probe
    except ImportError:
        return None
    ours = [r for r in results if r["engine"] == "kvmosaic" and succeeded(r) and WORKLOADS[r["workload"]].decodes]
    if not ours:
        return []
    measured_host = probe()
    hw = measured_host.spec
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
        weight_size = weight_bytes_per_param(res, param_count(model))
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
