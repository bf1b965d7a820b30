"""Distributed KV cache: borrowing off vs on, 2 to 4 instances with equal per-instance KV budgets.

Workload: a few long-context requests (each longer than one instance's pool) mixed with many short
ones, all submitted at once and routed least-loaded. With borrowing off a long request can never
fit one instance and is rejected at admission; with borrowing on it borrows blocks from the other
instances and its attention runs partly where those blocks live. Reports the longest context served,
throughput, preemptions, loans, and the cost of distributed attention per step and per layer call.

    HF_HUB_OFFLINE=1 nice -n 19 .venv/bin/python benchmarks/distkv.py --instances 2 3 4

``--stream`` runs the paper's comparison instead, at equal total KV memory and cores, on a steady
stream of short requests (Poisson, --short-rate a second) plus a long one every --long-every
seconds whose context exceeds one instance's pool: (a) static partitioning (N instances, borrowing
off: the long ones are rejected), (b) one instance holding the combined pool on all cores, (c) N
instances borrowing with creditors always attending themselves (borrowing-push), (d) N instances
borrowing with K/V pulls (borrowing). Reported: output tok/s, longest context served, TTFT and
TPOT p50/p99 of the short requests, split by where they ran (alone; on a creditor while a long
request runs on another instance; next to a long request), loans, K/V pulls, and the distributed
attention per remote step and per creditor call.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/distkv.py --stream --instances 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

import numpy as np
import ray
import torch
from bench_results import add_output_arg, write_record
from distkv_probe import LANE_KEYS_BLOCKS, lane_vs_local

from kvmosaic import SamplingParams
from kvmosaic.config import CacheConfig, DistributedConfig, EngineConfig, SchedulerConfig
from kvmosaic.distributed.channel import ChannelClient
from kvmosaic.distributed.cluster import Cluster
from kvmosaic.ops.cpu import isa_summary


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (length,), generator=gen).tolist() for _ in range(num)]


def engine_config(args: argparse.Namespace, instances: int) -> EngineConfig:
    return EngineConfig(
        dtype=args.dtype, num_threads=max(1, (os.cpu_count() or 1) // instances),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.blocks, num_host_blocks=0,
                          enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype),
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
    channel = ChannelClient(ray.get(cluster.instances[1].info.remote())["channel"], timeout=30.0,
                            secret=cluster.dist_config.cluster_secret)
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


# ---------------------------------------------------------------- --stream: the paper's comparison
def stream_schedule(args: argparse.Namespace) -> list[tuple[float, str, list[int], int]]:
    """(arrival second, kind, prompt, max tokens), the same for every mode."""
    gen = torch.Generator().manual_seed(args.seed)
    items, t = [], 0.0
    while True:
        t += float(torch.empty(1).exponential_(args.short_rate, generator=gen))
        if t >= args.duration:
            break
        items.append((t, "short", torch.randint(100, 40000, (args.short_len,), generator=gen).tolist(),
                      args.output_len * 2))
    t = args.long_every / 2
    while t < args.duration:
        items.append((t, "long", torch.randint(100, 40000, (args.long_len,), generator=gen).tolist(), args.output_len))
        t += args.long_every
    return sorted(items, key=lambda item: item[0])


def stream_run(args: argparse.Namespace, mode: str, instances: int) -> dict:
    borrowing = mode.startswith("borrowing")
    n = 1 if mode == "one-instance" else instances
    config = dataclasses.replace(engine_config(args, n),
                                 cache=dataclasses.replace(engine_config(args, n).cache,
                                                           num_blocks=args.blocks * instances // n))
    cluster = Cluster(config, DistributedConfig(num_instances=n, enable_borrowing=borrowing, dgfm_interval=8,
                                                kv_pull=mode != "borrowing-push",
                                                decode_lane=mode != "borrowing-channel",
                                                lane_spin_us=args.lane_spin_us,
                                                lane_shared_memory=mode != "borrowing-socket"))
    items = stream_schedule(args)
    try:
        warm = cluster.add_request(None, items[0][2][:16], SamplingParams(max_tokens=2, ignore_eos=True))
        while cluster.has_unfinished():
            cluster.step()
        del warm
        start = time.perf_counter()
        kinds, arrived, first, last, counts, ended, rejected, where = {}, {}, {}, {}, {}, {}, 0, {}
        pending = list(items)
        while pending or cluster.has_unfinished():
            now = time.perf_counter() - start
            while pending and pending[0][0] <= now:
                t, kind, tokens, max_tokens = pending.pop(0)
                try:
                    rid = cluster.add_request(None, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                           ignore_eos=True))
                except ValueError:
                    rejected += 1
                    continue
                kinds[rid], arrived[rid], counts[rid], where[rid] = kind, start + t, 0, cluster.route[rid]
            for out in cluster.step():
                stamp = time.perf_counter()
                produced = len(out.outputs[0].token_ids)
                if produced > counts.get(out.request_id, 0):
                    first.setdefault(out.request_id, stamp)
                    last[out.request_id], counts[out.request_id] = stamp, produced
                if out.finished:
                    ended[out.request_id] = (stamp, out.outputs[0].finish_reason)
            if not cluster.has_unfinished() and pending:
                time.sleep(max(0.0, min(0.01, pending[0][0] - (time.perf_counter() - start))))
        elapsed = time.perf_counter() - start
        stats = cluster.stats()
        lane = (lane_vs_local(cluster, config, args.lane_spin_us, mode != "borrowing-socket")
                if borrowing else None)
    finally:
        cluster.shutdown()
    done = [r for r, (_, reason) in ended.items() if reason == "length"]
    longs = [(arrived[r], ended[r][0], where[r]) for r in done if kinds[r] == "long"]
    report: dict = {"mode": mode, "instances": n, "blocks_per_instance": config.cache.num_blocks,
                    "threads": config.num_threads, "seconds": round(elapsed, 2),
                    "output_tok_s": round(sum(counts[r] for r in done) / elapsed, 1),
                    "completed_short": sum(kinds[r] == "short" for r in done),
                    "completed_long": len(longs), "rejected": rejected,
                    "longest_context": max((args.long_len if kinds[r] == "long" else args.short_len) + counts[r]
                                           for r in done),
                    "loans": int(stats.get("dist_loans_total", 0))}

    def label(r: str) -> str:
        """A short request ran alone, next to a long one on its own instance, or on a creditor of one
        (another instance, while a long request ran there and none on its own)."""
        running = {w == where[r] for a, e, w in longs if a < ended[r][0] and arrived[r] < e}
        return "short_with_long_here" if True in running else "short_on_creditor" if running else "short_alone"

    for name in ("short_alone", "short_on_creditor", "short_with_long_here"):
        rids = [r for r in done if kinds[r] == "short" and label(r) == name]
        ttft = [first[r] - arrived[r] for r in rids]
        tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in rids if counts[r] > 1]
        report[name] = {"n": len(rids), **{f"ttft_p{q}_ms": _pct(ttft, q) for q in (50, 99)},
                         **{f"tpot_p{q}_ms": _pct(tpot, q) for q in (50, 99)}}
    alone, creditor = report["short_alone"]["tpot_p99_ms"], report["short_on_creditor"]["tpot_p99_ms"]
    report["creditor_tpot_p99_ratio"] = round(creditor / alone, 2) if alone and creditor else None
    steps, calls = stats.get("dist_remote_steps", 0), stats.get("dist_remote_calls", 0)
    report["dist_attn_ms_per_step"] = round(1000 * stats.get("dist_remote_seconds", 0.0) / steps, 1) if steps else 0
    report["ms_per_creditor_call"] = round(1000 * stats.get("dist_remote_seconds", 0.0) / calls, 2) if calls else 0
    report["kv_pulls"] = int(stats.get("dist_kv_pulls", 0))
    report["lane_calls"] = int(stats.get("dist_lane_calls", 0))

    def per_call(key: str) -> float:
        return round(1000 * stats.get(key, 0.0) / calls, 3) if calls else 0.0

    # a layer call's cost on the debtor, split: waiting on the creditor (transfer and its compute), the
    # creditor's own compute, merging the partials
    report["per_call_ms"] = {"debtor": per_call("dist_remote_seconds"), "wait": per_call("dist_remote_wait_seconds"),
                             "creditor_compute": per_call("dist_remote_compute_seconds"),
                             "merge": per_call("dist_remote_merge_seconds")}
    report["lane_vs_local"] = lane
    return report


def _pct(values: list[float], q: int) -> float | None:
    return round(1000 * float(np.percentile(values, q)), 1) if values else None


def print_stream(reports: list[dict], args: argparse.Namespace) -> None:
    print(f"\nhost ISA: {isa_summary()}; {args.duration:.0f} s of arrivals: {args.short_len}-token prompts at "
          f"{args.short_rate}/s ({args.output_len * 2} out), a {args.long_len}-token prompt ({args.output_len} out) "
          f"every {args.long_every:.0f} s; {args.blocks} blocks x {args.block_size} tokens per instance")
    print("short requests' TTFT and TPOT, p50/p99 ms (n): alone; on a creditor while a long request runs "
          "elsewhere; next to a long request on their own instance")
    print(f"{'mode':<15}{'inst':>5}{'tok/s':>7}{'short':>6}{'long':>5}{'rej':>4}{'longest':>8}{'loans':>6}{'pulls':>6}"
          f"{'ms/call':>8}  {'TTFT alone':<16}{'creditor':<16}{'here':<16}{'TPOT alone':<16}{'creditor':<16}here")

    def cell(part: dict, kind: str) -> str:
        return f"{part[f'{kind}_p50_ms']}/{part[f'{kind}_p99_ms']} ({part['n']})"

    for r in reports:
        parts = [r["short_alone"], r["short_on_creditor"], r["short_with_long_here"]]
        print(f"{r['mode']:<15}{r['instances']:>5}{r['output_tok_s']:>7}{r['completed_short']:>6}"
              f"{r['completed_long']:>5}{r['rejected']:>4}{r['longest_context']:>8}{r['loans']:>6}{r['kv_pulls']:>6}"
              f"{r['ms_per_creditor_call']:>8}  " + "".join(f"{cell(p, 'ttft'):<16}" for p in parts)
              + "".join(f"{cell(p, 'tpot'):<16}" for p in parts))
    for r in reports:
        if r.get("per_call_ms") and r["per_call_ms"]["debtor"]:
            print(f"{r['mode']}: per layer call, ms: {r['per_call_ms']} ({r['lane_calls']} of the calls over the "
                  f"decode lane); one decode row over {LANE_KEYS_BLOCKS} lent blocks: {r['lane_vs_local']}")


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
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "int4", "oaken"],
                        help="the instances' KV pools: lent blocks stay in this format where they live")
    add_output_arg(parser, "distkv")
    parser.add_argument("--stream", action="store_true", help="static vs one instance vs borrowing, on a stream")
    parser.add_argument("--duration", type=float, default=40.0, help="--stream: seconds of arrivals")
    parser.add_argument("--short-rate", type=float, default=2.0, help="--stream: short requests a second")
    parser.add_argument("--long-every", type=float, default=10.0, help="--stream: seconds between long requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lane-spin-us", type=int, default=DistributedConfig().lane_spin_us,
                        help="microseconds the decode lane's ends poll before they sleep")
    parser.add_argument("--modes", nargs="+", default=["static", "one-instance", "borrowing-push", "borrowing"],
                        choices=["static", "one-instance", "borrowing-push", "borrowing", "borrowing-channel",
                                 "borrowing-socket"],
                        help="--stream: borrowing-push: creditors always attend themselves (no K/V pulls); "
                             "borrowing-channel: no decode lane (every call over the pickled channel); "
                             "borrowing-socket: the decode lane over its socket, not shared rings")
    args = parser.parse_args()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    if args.stream:
        try:
            reports = [stream_run(args, mode, args.instances[0]) for mode in args.modes]
        finally:
            ray.shutdown()
        print_stream(reports, args)
        write_record("distkv_stream", reports, out=args.out, config=vars(args))
        return
    rows = []
    try:
        for instances in args.instances:
            for borrowing, lockstep in ((False, False), (True, True), (True, False)):
                rows.append(run(args, instances, borrowing, lockstep))
                print(rows[-1], flush=True)
    finally:
        ray.shutdown()
    print_table(rows)
    meta = dict(vars(args))
    meta.update({"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                 "ray": ray.__version__, "tokens_per_instance": args.blocks * args.block_size})
    write_record("distkv", rows, out=args.out, config=meta)


if __name__ == "__main__":
    main()
