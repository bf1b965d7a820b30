"""kvmosaic's peer-benchmark results against this machine's roofline (the planner's probe).

Runs in the main venv (it imports kvmosaic's planner), called by benchmarks/peers.py.
"""

from __future__ import annotations

from peer_runners.common import WEIGHT_FORMATS, WORKLOADS
from peer_runners.report import succeeded


def roofline_rows(results: list[dict]) -> list[dict] | None:
    """kvmosaic against this machine's roofline, from the planner (kvmosaic/planner).

    A: a decode step reads the weights and the KV cache once: their bytes / measured read bandwidth,
       against the measured seconds per token.
    B: prefill matmul FLOPs / measured matmul FLOP/s plus 128 decode steps of 64 sequences, each the
       larger of its FLOP and weight-read times (plus KV reads), against the measured wall time.
    q8_0 / q4_1 weights count their GGUF bytes (scales included), with float32 KV and fp32 matmuls.
    Attention FLOPs and activations are ignored. Returns None when the planner is not there.
    """
    try:
        from kvmosaic.planner import MODEL_PRESETS, param_count, roofline_step_time
        from kvmosaic.planner.probe import probe
        from kvmosaic.planner.roofline import dtype_bytes
    except ImportError:
        return None
    ours = [r for r in results if r["engine"] == "kvmosaic" and succeeded(r) and r["workload"] in ("A", "B")]
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
        compute = "bf16" if dtype == "bfloat16" else "fp32"
        rate = getattr(measured_host, compute)
        if rate.flops is None:
            rows.append({"workload": work.name, "dtype": dtype, "missing": f"no {compute} matmul figure: {rate.path}"})
            continue
        weight_size = dtype_bytes(dtype)
        kv_size = 4 if dtype in WEIGHT_FORMATS else weight_size
        batch, context = work.num_prompts, work.prompt_len + work.max_tokens // 2
        step = roofline_step_time(model, hw, batch, context, weight_size, kv_size, compute_dtype=compute)
        if work.name == "A":
            roof, measured, unit = step.total_s, 1 / res["tokens_per_s"], "s/token"
        else:
            prefill = 2 * body * batch * work.prompt_len / rate.flops
            roof, measured, unit = prefill + work.max_tokens * step.total_s, res["seconds"], "s"
        rows.append({"workload": work.name, "dtype": dtype, "unit": unit, "roofline": roof,
                     "measured": measured, "efficiency": roof / measured,
                     "read_bandwidth": hw.hbm_bandwidth, "matmul_flops": rate.flops, "matmul_path": rate.path})
    return rows


def roofline_lines(rows: list[dict] | None) -> list[str]:
    """A share of the roofline only where it means one: a run faster than its roofline says the
    probe did not find this host's fastest path, so no share is printed for it."""
    from kvmosaic.planner.roofline import format_rate

    if rows is None:
        return ["roofline: planner not available"]
    if not rows:
        return ["roofline: no kvmosaic A or B result to compare"]
    lines = ["kvmosaic vs roofline (planner probe of this machine; A: weights+KV bytes / read bandwidth, "
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
