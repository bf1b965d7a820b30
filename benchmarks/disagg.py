"""Colocated against disaggregated serving on the same cores, under long prompts among short chats.

Two servers take the same load in turn (ABBA rounds, one at a time): ``kvmosaic serve`` (one engine
on every core) and ``kvmosaic serve --prefill-workers 1 --decode-workers 1`` (two Ray actors with
half the cores each). Short chats arrive as a Poisson process; every ``--long-every`` seconds a long
prompt arrives as well. In the colocated engine a long prompt's prefill shares steps with everyone's
decode, so their tokens stall behind it; disaggregated, it runs on the prefill worker and only its K/V
reaches the decode worker. Prompts are random token ids (no prefix-cache hits, exact lengths).
``--modes colocated disaggregated disagg-int8`` adds a run whose K/V travels as int8 records.

Reported per mode: TTFT, TPOT and ITL p50/p99 of the short chats and of the long prompts, goodput
(requests a second meeting the SLO: TTFT <= --ttft-slo and TPOT <= --tpot-slo), and for the
disaggregated mode the prompt K/V moved per request, the time to export and fetch it, and that cost
per prompt token (read from the server's /metrics).

    python benchmarks/disagg.py                      # ~7 minutes on 2 cores
    python benchmarks/disagg.py --rounds 1 --duration 30 --long-len 1024
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx
import numpy as np
from bench_results import add_output_arg, write_record
from serving import RequestResult, RequestSpec, launch, percentiles, run_request

from kvmosaic.ops.cpu import isa_summary

MODES = {"colocated": "", "disaggregated": "--prefill-workers 1 --decode-workers 1",
         "disagg-int8": "--prefill-workers 1 --decode-workers 1 --kv-transfer-dtype int8"}
TRANSFER_KEYS = ("disagg_prefills", "disagg_kv_bytes_sent", "disagg_export_seconds", "disagg_kv_bytes_received",
                 "disagg_transfer_seconds", "disagg_failed_transfers", "disagg_recomputed_prefills")


# ---------------------------------------------------------------- workload
def schedule(args: argparse.Namespace) -> list[tuple[float, str, RequestSpec]]:
    """(arrival offset in seconds, class, request) for one round; the same in every round and mode."""
    rng = np.random.default_rng(args.seed)
    items: list[tuple[float, str, RequestSpec]] = []
    t = 0.0
    while True:
        t += rng.exponential(1.0 / args.short_rate)
        if t >= args.duration:
            break
        n_in = int(rng.integers(args.short_in // 2, args.short_in * 3 // 2 + 1))
        items.append((t, "short", RequestSpec(rng.integers(1000, 30000, n_in).tolist(), n_in, args.short_out)))
    t = args.long_every / 2
    while t < args.duration:
        prompt = rng.integers(1000, 30000, args.long_len).tolist()
        items.append((t, "long", RequestSpec(prompt, args.long_len, args.long_out)))
        t += args.long_every
    return sorted(items, key=lambda item: item[0])


async def run_round(args: argparse.Namespace, items: list[tuple[float, str, RequestSpec]]
                    ) -> list[tuple[str, RequestResult]]:
    # idle connections expire before the server's keep-alive (5 s) closes them under a new request
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        warm = [RequestSpec(items[0][2].prompt, items[0][2].prompt_len, 4)] * 2
        for spec in warm:  # the first requests pay for lazy set-up (pages, kernels, the Ray path)
            await run_request(client, args, spec)
        start = time.monotonic()

        async def one(offset: float, kind: str, spec: RequestSpec) -> tuple[str, RequestResult]:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            return kind, await run_request(client, args, spec)

        return list(await asyncio.gather(*[one(*item) for item in items]))


def scrape(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("kvmosaic_") and "{" not in name:
            values[name.removeprefix("kvmosaic_").removesuffix("_total")] = float(value)
    return values


# ---------------------------------------------------------------- summary
def tpot(r: RequestResult) -> float:
    return (r.e2e - r.ttft) / (r.output_len - 1)


def summarize(args: argparse.Namespace, rounds: list[list[tuple[str, RequestResult]]],
              transfers: list[dict[str, float]]) -> dict:
    results = [pair for one in rounds for pair in one]
    duration = args.duration * len(rounds)
    errors = [f"{kind}: {r.error}" for kind, r in results if not r.ok]
    report: dict = {"requests": len(results), "errors": len(errors), "error_samples": errors[:5]}
    for kind in ("short", "long", "all"):
        ok = [r for k, r in results if r.ok and kind in (k, "all")]
        report[kind] = {"completed": len(ok), "ttft_ms": percentiles([r.ttft for r in ok]),
                        "tpot_ms": percentiles([tpot(r) for r in ok if r.output_len > 1]),
                        "itl_ms": percentiles([g for r in ok for g in r.itl])}
    good = [r for _, r in results if r.ok and r.ttft <= args.ttft_slo and r.output_len > 1
            and tpot(r) <= args.tpot_slo]
    report["goodput_rps"] = len(good) / duration
    report["slo_attainment"] = len(good) / max(len(results), 1)
    total = {key: sum(t.get(key, 0.0) for t in transfers) for key in TRANSFER_KEYS}
    prefills = total["disagg_prefills"]
    if prefills:
        prompt_tokens = sum(r.prompt_len for _, r in results if r.ok)
        seconds = total["disagg_export_seconds"] + total["disagg_transfer_seconds"]
        report["transfer"] = {**total, "kv_mib_per_request": total["disagg_kv_bytes_received"] / prefills / 2**20,
                              "transfer_ms_per_request": 1000 * seconds / prefills,
                              "transfer_us_per_prompt_token": 1e6 * seconds / max(prompt_tokens, 1)}
    return report


def print_table(args: argparse.Namespace, reports: dict[str, dict], isa: str) -> None:
    print(f"\nhost ISA: {isa}; {args.rounds} round(s) x {args.duration:.0f} s; short chats {args.short_rate}/s "
          f"({args.short_in // 2}-{args.short_in * 3 // 2} in, {args.short_out} out), a {args.long_len}-token "
          f"prompt ({args.long_out} out) every {args.long_every:.0f} s; "
          f"SLO: TTFT <= {args.ttft_slo:g} s, TPOT <= {1000 * args.tpot_slo:g} ms")
    head = (f"{'mode':<14}{'class':<7}{'done':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
            f"{'ITL p50':>9}{'ITL p99':>9}{'ITL max':>9}")
    print(head + "   (ms)")
    for mode, rep in reports.items():
        for kind in ("short", "long", "all"):
            row = rep[kind]
            cells = [row[m][q] for m in ("ttft_ms", "tpot_ms") for q in ("p50", "p99")]
            cells += [row["itl_ms"][q] for q in ("p50", "p99", "max")]
            widths = [10, 10, 10, 10, 9, 9, 9]
            print(f"{mode:<14}{kind:<7}{row['completed']:>5}"
                  + "".join(f"{c:>{w}.0f}" if c is not None else f"{'-':>{w}}" for c, w in zip(cells, widths)))
    print(f"{'mode':<14}{'goodput req/s':>14}{'SLO met':>9}{'errors':>8}")
    for mode, rep in reports.items():
        print(f"{mode:<14}{rep['goodput_rps']:>14.2f}{rep['slo_attainment']:>9.0%}{rep['errors']:>8}")
    for mode, rep in reports.items():
        for error in rep["error_samples"]:
            print(f"{mode} error: {error}")
        if "transfer" in rep:
            t = rep["transfer"]
            print(f"{mode}: K/V {t['kv_mib_per_request']:.2f} MiB a request, export + fetch "
                  f"{t['transfer_ms_per_request']:.1f} ms a request ({t['transfer_us_per_prompt_token']:.1f} us a "
                  f"prompt token), {t['disagg_failed_transfers']:.0f} failed, "
                  f"{t['disagg_recomputed_prefills']:.0f} recomputed")
    short = {mode: rep["short"]["tpot_ms"]["p99"] for mode, rep in reports.items()}
    for mode in short:
        if mode != "colocated" and short.get("colocated") and short[mode]:
            print(f"short-chat TPOT p99, colocated / {mode}: {short['colocated'] / short[mode]:.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode, ABBA-interleaved")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["colocated", "disaggregated"],
                   help="disagg-int8: the prompt K/V sent as int8 records")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per round")
    p.add_argument("--short-rate", type=float, default=1.0, help="short chats a second (Poisson)")
    p.add_argument("--short-in", type=int, default=128, help="mean short prompt length (uniform +-50%%)")
    p.add_argument("--short-out", type=int, default=96)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--long-out", type=int, default=32)
    p.add_argument("--long-every", type=float, default=10.0, help="seconds between long prompts")
    p.add_argument("--ttft-slo", type=float, default=4.0, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="seconds")
    p.add_argument("--serve-args", default="", help="extra `kvmosaic serve` arguments for both modes")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    add_output_arg(p, "disagg")
    args = p.parse_args(argv)
    args.endpoint = "completions"  # what serving.run_request reads
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    isa = isa_summary()
    items = schedule(args)
    order = [mode for r in range(args.rounds) for mode in (args.modes if r % 2 == 0 else args.modes[::-1])]
    rounds: dict[str, list] = {mode: [] for mode in args.modes}
    transfers: dict[str, list] = {mode: [] for mode in args.modes}
    for mode in order:
        args.launch = f"{MODES[mode]} {args.serve_args}".strip()
        proc = launch(args)
        try:
            before = scrape(args.base_url)
            results = asyncio.run(run_round(args, items))
            time.sleep(1.0)  # the last outputs' stats reach /metrics
            after = scrape(args.base_url)
        finally:
            proc.terminate()
            proc.wait(120)
        rounds[mode].append(results)
        transfers[mode].append({k: after.get(k, 0.0) - before.get(k, 0.0) for k in TRANSFER_KEYS})
        print(f"{mode}: {sum(r.ok for _, r in results)}/{len(results)} ok, "
              f"K/V blocks left in use: {after.get('kv_blocks_used')}", flush=True)
    reports = {mode: summarize(args, rounds[mode], transfers[mode]) for mode in args.modes}
    print_table(args, reports, isa)
    config = {k: v for k, v in vars(args).items() if k not in ("launch", "base_url", "server_pid")}
    rows = [{"mode": mode, "class": kind, **rep[kind], "goodput_rps": rep["goodput_rps"],
             "slo_attainment": rep["slo_attainment"], "errors": rep["errors"]}
            for mode, rep in reports.items() for kind in ("short", "long")]
    write_record("disagg", rows, out=args.out, config=config, extra={"modes": MODES, "reports": reports})
    return 0 if all(rep["errors"] == 0 for rep in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
