"""Online serving benchmark against any OpenAI-compatible endpoint (kvmosaic, vLLM, llama.cpp).

Requests arrive as a Poisson process (or gamma with --burstiness) at --request-rate, optionally
capped at --max-concurrency in flight. Prompt/output lengths are fixed (--input-len/--output-len)
or drawn from lognormals fitted to the Azure LLM-inference 2023 conversation trace (input
median 1020 / mean 1155 tokens, output median 129 / mean 211), multiplied by --scale. Every
request streams; TTFT is the first content chunk, ITL the gaps between chunks, TPOT
(e2e - ttft) / (output tokens - 1). Output is forced to its length with ignore_eos.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rate 2 --num-prompts 60 \\
        --dataset azure-conv --scale 0.1
    python benchmarks/serving.py --launch "--dtype float32" --request-rate 1 --soak 10
    python benchmarks/serving.py --launch --request-rate 2 --soak 30 --mix plain,stream,structured,tools,beam,disconnect

--soak MINUTES keeps the load on for that long and samples the server's RSS and KV blocks
(from /metrics, or psutil with --server-pid) to report their growth and the blocks left after
the drain. --launch starts ``kvmosaic serve`` on a free port for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving_mix.py beside it, also when loaded by path
import serving_mix  # noqa: E402
import serving_soak  # noqa: E402
from bench_results import add_output_arg, write_record  # noqa: E402

AZURE_CONV = {"input": (1020, 1155), "output": (129, 211)}  # (median, mean) tokens
WORDS = ["time", "people", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye",
         "woman", "place", "work", "week", "case", "point", "number", "group", "problem", "fact", "river", "story",
         "light", "music", "garden", "city", "water", "letter", "paper", "window"]


@dataclass(slots=True)
class RequestSpec:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    kind: str = "stream"


# ---------------------------------------------------------------- workload
def lognormal_params(median: float, mean: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with this median and mean: median = e^mu, mean = e^(mu + sigma^2 / 2)."""
    return math.log(median), math.sqrt(2.0 * math.log(mean / median))


def draw_lengths(args: argparse.Namespace, rng: np.random.Generator, count: int) -> list[tuple[int, int]]:
    if args.dataset == "fixed":
        return [(args.input_len, args.output_len)] * count
    lengths = []
    for kind, limit in (("input", args.max_input_len), ("output", args.max_output_len)):
        mu, sigma = lognormal_params(*AZURE_CONV[kind])
        drawn = rng.lognormal(mu, sigma, count) * args.scale
        lengths.append(np.clip(np.rint(drawn), 1, limit).astype(int).tolist())
    return list(zip(*lengths))


def make_requests(args: argparse.Namespace, rng: np.random.Generator, count: int) -> list[RequestSpec]:
    specs = []
    for prompt_len, output_len in draw_lengths(args, rng, count):
        if args.endpoint == "chat":
            prompt: list[int] | str = " ".join(rng.choice(WORDS, prompt_len).tolist())
        else:  # token ids: exact lengths on any server of the same vocabulary, no prefix-cache hits
            prompt = rng.integers(args.token_id_low, args.token_id_high, prompt_len).tolist()
        specs.append(RequestSpec(prompt, prompt_len, output_len))
    return specs


def request_body(args: argparse.Namespace, spec: RequestSpec) -> dict:
    body = {"model": args.model, "max_tokens": spec.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


# ---------------------------------------------------------------- one request
async def run_mixed(client: httpx.AsyncClient, args: argparse.Namespace, spec: RequestSpec,
                    kind: str) -> RequestResult:
    """One request of a --mix kind other than "stream"; its latency counts as its time to first token."""
    if kind == "stream":
        return await run_request(client, args, spec)
    path, body = serving_mix.request(kind, args.model, spec.prompt, spec.output_len)
    result = RequestResult(ok=False, prompt_len=spec.prompt_len, kind=kind)
    start = time.perf_counter()
    try:
        if kind == "disconnect":
            result.ttft, result.error = await serving_mix.run_disconnect(client, path, body)
        else:
            result.output_len, result.error = await serving_mix.run_unstreamed(client, kind, path, body)
            result.ttft = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = f"{kind}: {type(exc).__name__}: {exc}"[:200]
    result.e2e = time.perf_counter() - start
    result.ok = result.error is None
    return result


async def run_request(client: httpx.AsyncClient, args: argparse.Namespace, spec: RequestSpec) -> RequestResult:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    result = RequestResult(ok=False, prompt_len=spec.prompt_len)
    start = last = time.perf_counter()
    chunks, usage = 0, None
    try:
        async with client.stream("POST", path, json=request_body(args, spec)) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))[:200]
                    return result
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.e2e = time.perf_counter() - start
    result.output_len = usage["completion_tokens"] if usage else chunks
    result.ok = result.ttft is not None
    result.error = None if result.ok else "no output"
    return result


# ---------------------------------------------------------------- load
async def run_load(args: argparse.Namespace, specs: list[RequestSpec], deadline: float | None) -> list[RequestResult]:
    """Send specs at the arrival process; with a deadline, cycle through specs until it passes."""
    rng = np.random.default_rng(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    # idle connections expire before the server's keep-alive (5 s) closes them under a new request
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits,
                                 headers=auth_headers(args)) as client:

        async def one(spec: RequestSpec, kind: str) -> RequestResult:
            if limit is None:
                return await run_mixed(client, args, spec, kind)
            async with limit:
                return await run_mixed(client, args, spec, kind)

        tasks = []
        for i in range(len(specs) if deadline is None else sys.maxsize):
            if deadline is not None and time.monotonic() >= deadline:
                break
            kind = str(rng.choice(args.mix)) if args.mix else "stream"
            tasks.append(asyncio.create_task(one(specs[i % len(specs)], kind)))
            if math.isfinite(args.request_rate):
                shape = args.burstiness
                await asyncio.sleep(rng.gamma(shape, 1.0 / (args.request_rate * shape)))
        return list(await asyncio.gather(*tasks))


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)},
            "max": float(arr.max())}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "duration_s": duration, "completed": len(ok), "errors": len(errors), "error_samples": errors[:5],
        "completed_by_kind": dict(sorted(Counter(r.kind for r in ok).items())),
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "mean_input_len": in_tokens / max(len(ok), 1), "mean_output_len": out_tokens / max(len(ok), 1),
        "ttft_ms": percentiles([r.ttft for r in ok]), "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([g for r in ok for g in r.itl]), "e2e_ms": percentiles([r.e2e for r in ok]),
    }


# ---------------------------------------------------------------- main
async def benchmark(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    specs = make_requests(args, rng, args.num_prompts)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout,
                                 headers=auth_headers(args)) as client:  # warm-up
        await asyncio.gather(*[run_request(client, args, RequestSpec(s.prompt, s.prompt_len, 4)) for s in specs[:2]])
    samples: list[dict] = []
    stop = asyncio.Event()
    sampler = (asyncio.create_task(serving_soak.sample_until(stop, args.base_url, args.server_pid, auth_headers(args),
                                                            args.sample_interval, samples)) if args.soak else None)
    deadline = time.monotonic() + args.soak * 60 if args.soak else None
    start = time.perf_counter()
    results = await run_load(args, specs, deadline)
    duration = time.perf_counter() - start
    report = {"config": {k: v for k, v in vars(args).items() if k != "launch_process"}, **summarize(results, duration)}
    if sampler is not None:
        stop.set()
        await sampler
        await asyncio.sleep(1.0)
        after_drain = serving_soak.scrape(args.base_url, args.server_pid, auth_headers(args))
        report["soak"] = serving_soak.soak_report(samples, after_drain)
    return report


def print_report(report: dict) -> None:
    cfg = report["config"]
    print(f"\n{cfg['base_url']}  {cfg['endpoint']}  rate={cfg['request_rate']}  concurrency={cfg['max_concurrency']}"
          f"  dataset={cfg['dataset']} scale={cfg['scale']}")
    print(f"completed {report['completed']}  errors {report['errors']}  in {report['duration_s']:.1f} s  "
          f"mean in/out {report['mean_input_len']:.0f}/{report['mean_output_len']:.0f} tokens")
    print(f"throughput: {report['request_throughput']:.2f} req/s, {report['output_throughput']:.1f} output tok/s, "
          f"{report['total_token_throughput']:.1f} total tok/s")
    print(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = report[key]
        print(f"{key[:-3].upper():<6}" + "".join(f"{row[q]:>10.1f}" if row[q] is not None else f"{'-':>10}"
                                                 for q in ("mean", "p50", "p90", "p99")))
    if "soak" in report:
        print("soak:", json.dumps({k: v for k, v in report["soak"].items() if k != "series"}, indent=1))
    for error in report["error_samples"]:
        print("error:", error)


def launch(args: argparse.Namespace) -> subprocess.Popen:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "kvmosaic.entrypoints.cli", "serve", "--port", str(port), "--log-level", "warning",
           *shlex.split(args.launch)]
    proc = subprocess.Popen(cmd)
    args.base_url, args.server_pid = f"http://127.0.0.1:{port}", proc.pid
    for _ in range(600):
        try:
            if httpx.get(f"{args.base_url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit("the launched server did not come up")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", nargs="?", const="", default=None, metavar="SERVE_ARGS",
                   help="start `kvmosaic serve SERVE_ARGS` on a free port for the run")
    p.add_argument("--server-pid", type=int, default=None, help="read the server's RSS with psutil")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--dataset", choices=["fixed", "azure-conv"], default="fixed")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the azure-conv lengths")
    p.add_argument("--max-input-len", type=int, default=6144)
    p.add_argument("--max-output-len", type=int, default=2048)
    p.add_argument("--token-id-low", type=int, default=1000)
    p.add_argument("--token-id-high", type=int, default=30000)
    p.add_argument("--soak", type=float, default=0.0, metavar="MINUTES")
    p.add_argument("--mix", type=serving_mix.parse_kinds, default=None, metavar="KINDS",
                   help=f"comma-separated request kinds drawn at random ({','.join(serving_mix.KINDS)}); "
                        "default: streamed requests only")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--sample-interval", type=float, default=5.0, help="seconds between soak samples")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    add_output_arg(p, "serving")  # serving_soak.json with --soak
    args = p.parse_args(argv)
    if args.request_rate <= 0 or args.burstiness <= 0 or args.scale <= 0:
        p.error("--request-rate, --burstiness and --scale must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = launch(args) if args.launch is not None else None
    try:
        report = asyncio.run(benchmark(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print_report(report)
    config = report.pop("config")
    row = {"request_rate": config["request_rate"], **report}
    write_record("serving_soak" if args.soak else "serving", [row], out=args.out, config=config)
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
