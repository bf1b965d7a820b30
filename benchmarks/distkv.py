"""Distributed KV cache: borrowing off vs on, 2 to 4 instances with equal per-instance KV budgets.

Workload: a few long-context requests (each longer than one instance's pool) mixed with many short
ones, all submitted at once and routed least-loaded. With borrowing off a long request can never
fit one instance and is rejected at admission; with borrowing on it borrows blocks from the other
instances and its attention runs partly where those blocks live. Reports the longest context served,
throughput, preemptions, loans, and the cost of distributed attention per step and per layer call.

    HF_HUB_OFFLINE=1 nice -n 19 .venv/bin/python benchmarks/distkv.py --instances 2 3 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import ray
import torch

from kvmosaic import SamplingParams
from kvmosaic.config import CacheConfig, DistributedConfig, EngineConfig, SchedulerConfig
from kvmosaic.distributed.channel import ChannelClient
from kvmosaic.distributed.cluster import Cluster

RESULTS = Path(__file__).parent / "results"


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (length,), generator=gen).tolist() for _ in range(num)]


def engine_config(args: argparse.Namespace, instances: int) -> EngineConfig:
    return EngineConfig(
        dtype=args.dtype, num_threads=max(1, (os.cpu_count() or 1) // instances),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.blocks, num_host_blocks=0,
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk, max_model_len=4096),
    )


def run(args: argparse.Namespace, instances: int, borrowing: bool, lockstep: bool) -> dict:
    dist = DistributedConfig(num_instances=instances, enable_borrowing=borrowing, dgfm_interval=8, lockstep=lockstep)
    cluster = Cluster(engine_config(args, instances), dist)
    try:
        return {"stepping": "lock-step" if lockstep else "independent", **drive(cluster, args, instances, borrowing)}
    finally:
        cluster.shutdown()


def drive(cluster: Cluster, args: argparse.Namespace, instances: int, borrowing: bool) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    num_long = args.num_long if args.num_long is not None else max(1, instances // 2)
    longs = make_prompts(num_long, args.long_len, seed=1)
    shorts = make_prompts(args.num_short, args.short_len, seed=2)
    start = time.perf_counter()
    accepted, rejected = {}, 0
    for tokens in longs + shorts:
        try:
            accepted[cluster.add_request(None, tokens, params)] = len(tokens)
        except ValueError:
            rejected += 1
    finished, steps, max_debt = {}, 0, 0
    while cluster.has_unfinished():
        for out in cluster.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps % 4 == 0:
            max_debt = max(max_debt, cluster.ledger()["total_debt"])
    elapsed = time.perf_counter() - start
    rtt_ms = empty_call_ms(cluster)
    stats = cluster.stats()
    served = [accepted[r] + len(o.outputs[0].token_ids) for r, o in finished.items()
              if o.outputs[0].finish_reason == "length"]
    remote_steps = stats.get("dist_remote_steps", 0)
    calls = stats.get("dist_remote_calls", 0)
    seconds = stats.get("dist_remote_seconds", 0.0)
    return {
        "instances": instances, "borrowing": borrowing, "seconds": round(elapsed, 2),
        "requests_done": len(served), "rejected": rejected, "longest_context": max(served, default=0),
        "output_tok_s": round(sum(len(o.outputs[0].token_ids) for o in finished.values()) / elapsed, 1),
        "preemptions": int(stats["num_preemptions"]), "loans": int(stats.get("dist_loans_total", 0)),
        "max_debt_blocks": max_debt, "swaps": int(stats.get("dist_swaps_total", 0)),
        "cluster_steps": steps, "remote_steps": int(remote_steps),
        "dist_attn_ms_per_step": round(1000 * seconds / remote_steps, 1) if remote_steps else 0.0,
        "dist_attn_ms_per_layer_call": round(1000 * seconds / calls, 2) if calls else 0.0,
        "waiting_on_creditors_ms_per_step": round(1000 * stats.get("dist_remote_wait_seconds", 0.0) / remote_steps, 1)
        if remote_steps else 0.0,
        "remote_compute_ms_per_layer_call": round(1000 * stats.get("dist_remote_compute_seconds", 0.0) / calls, 3)
        if calls else 0.0,
        "merge_ms_per_layer_call": round(1000 * stats.get("dist_remote_merge_seconds", 0.0) / calls, 3)
        if calls else 0.0,
        "empty_call_ms": rtt_ms,
    }


def empty_call_ms(cluster: Cluster, calls: int = 50) -> float:
    """Round trip of a micro-attention call carrying no work: the fixed cost of the data plane per layer."""
    channel = ChannelClient(ray.get(cluster.instances[1].info.remote())["channel"], timeout=30.0)
    channel.call("attention", 0, [], 1.0)
    start = time.perf_counter()
    for _ in range(calls):
        channel.call("attention", 0, [], 1.0)
    elapsed = time.perf_counter() - start
    channel.close()
    return round(1000 * elapsed / calls, 3)


COLUMNS = ("instances", "borrowing", "stepping", "requests_done", "rejected", "longest_context", "seconds",
           "output_tok_s", "preemptions", "loans", "max_debt_blocks", "swaps", "remote_steps", "dist_attn_ms_per_step",
           "dist_attn_ms_per_layer_call", "waiting_on_creditors_ms_per_step", "remote_compute_ms_per_layer_call",
           "merge_ms_per_layer_call", "empty_call_ms")


def print_table(rows: list[dict]) -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--blocks", type=int, default=32, help="KV blocks per instance (equal budgets)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256, help="token budget of one step (prefill chunk)")
    parser.add_argument("--num-long", type=int, default=None, help="default: one per two instances")
    parser.add_argument("--long-len", type=int, default=600, help="longer than one instance's pool")
    parser.add_argument("--num-short", type=int, default=12)
    parser.add_argument("--short-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--json", default=None, help="where to write results (default benchmarks/results/)")
    args = parser.parse_args()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for instances in args.instances:
            for borrowing, lockstep in ((False, False), (True, True), (True, False)):
                rows.append(run(args, instances, borrowing, lockstep))
                print(rows[-1], flush=True)
    finally:
        ray.shutdown()
    print_table(rows)
    meta = {k: v for k, v in vars(args).items() if k != "json"}
    meta.update({"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                 "ray": ray.__version__, "tokens_per_instance": args.blocks * args.block_size})
    out = Path(args.json) if args.json else RESULTS / "distkv.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": meta, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
