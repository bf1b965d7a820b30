"""Shared by every peer runner: workloads, prompts, timing and the one JSON line a runner prints.

Runners run inside their engine's own venv, so this module uses only the standard library.
A runner supplies ``build(model_path, dtype, threads) -> engine`` where ``engine.generate(prompts,
max_tokens)`` returns the generated token ids of each prompt (greedy, EOS ignored, in order).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

# SmolLM2's tokenizer, which every real-size shape ships too (their vocabularies are at least as large);
# ids below 100 hold the special tokens
VOCAB_SIZE = 49152
# Float dtypes, and GGUF weight formats run with float32 activations (llama.cpp and kvmosaic only).
DTYPES = ("float32", "bfloat16", "q8_0", "q4_1", "q4_k_m")
WEIGHT_FORMATS = ("q8_0", "q4_1", "q4_k_m")
FIRST_TOKENS = 16  # greedy ids of the first prompt kept for the cross-engine check


class Unsupported(Exception):
    """The engine has no such precision (or mode) on this machine; reported as n/a, not as a failure."""


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    num_prompts: int
    prompt_len: int
    max_tokens: int
    metric: str  # what tokens_per_s counts
    # Batch workloads short enough to ride one of a noisy host's fast or slow phases time this many
    # runs, each on its own prompts, and keep the fastest.
    timed_runs: int = 1

    @property
    def single_stream_decode(self) -> bool:
        """One sequence's decode rate (prefill taken out), set against the read-bandwidth roofline."""
        return self.metric == "decode tok/s"

    @property
    def decodes(self) -> bool:
        """The workload generates past its first token (A, B, L), so the planner's roofline applies."""
        return self.max_tokens > 1

    @property
    def context(self) -> int:
        """Tokens a sequence holds at its end: what an engine's context window must fit."""
        return self.prompt_len + self.max_tokens


WORKLOADS = {
    "A": Workload("A", 1, 128, 128, "decode tok/s"),
    "B": Workload("B", 64, 128, 128, "output tok/s"),
    "C": Workload("C", 16, 512, 1, "prompt tok/s", timed_runs=3),
    # A at a long context: the float32 KV read each step is as large as the Q4_1 weights
    "L": Workload("L", 1, 2048, 128, "decode tok/s"),
    "S": Workload("S", 1, 128, 1, "start-up s"),  # process start -> first token
}


def context_window(work: Workload) -> int:
    """The context window a runner gives its engine: 1024 (what A, B and C have always run with), or
    the workload's context rounded up to 256 tokens when it needs more."""
    return max(1024, -(-work.context // 256) * 256)


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    """Distinct prompts of ordinary token ids, identical in every venv (no numpy/torch RNG)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB_SIZE) for _ in range(length)] for _ in range(num)]


def workload_prompts(work: Workload, run: int = 0) -> list[list[int]]:
    """The prompts of a workload's timed run ``run`` (run 0: the prompts every engine's first tokens
    are compared on)."""
    return make_prompts(work.num_prompts, work.prompt_len, seed=1000 + ord(work.name) + 1000 * run)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--model-path", default=None, help="HF dir, GGUF file or CTranslate2 dir (engine-specific)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--t0", type=float, default=None, help="time.time() when the parent started this process")
    return parser.parse_args(argv)


def _timed(engine, prompts, max_tokens) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = engine.generate(prompts, max_tokens)
    return time.perf_counter() - start, outs


def _check_lengths(outs: list[list[int]], work: Workload, max_tokens: int) -> None:
    short = [len(o) for o in outs if len(o) != max_tokens]
    if len(outs) != work.num_prompts or short:
        raise RuntimeError(f"workload {work.name}: expected {work.num_prompts} x {max_tokens} tokens, "
                           f"got {len(outs)} outputs, wrong lengths {short[:4]}")


def measure(engine, work: Workload) -> dict:
    """Warm up on other prompts of the same shape, then time the workload."""
    prompts = workload_prompts(work)
    warm = make_prompts(min(2, work.num_prompts), work.prompt_len, seed=7)
    engine.generate(warm, 2)
    if work.single_stream_decode:
        # Decode rate without the prefill: (t(N tokens) - t(1 token)) over N - 1 steps, best of 2 each.
        t_first = min(_timed(engine, prompts, 1)[0] for _ in range(2))
        runs = [_timed(engine, prompts, work.max_tokens) for _ in range(2)]
        seconds, outs = min(runs, key=lambda r: r[0])
        _check_lengths(outs, work, work.max_tokens)
        rate = (work.max_tokens - 1) / (seconds - t_first)
        return {"seconds": seconds, "ttft_s": t_first, "tokens": work.max_tokens, "tokens_per_s": rate,
                "first_tokens": outs[0][:FIRST_TOKENS]}
    runs = [_timed(engine, workload_prompts(work, run), work.max_tokens) for run in range(work.timed_runs)]
    for _, outs in runs:
        _check_lengths(outs, work, work.max_tokens)
    counted = work.num_prompts * (work.prompt_len if work.name == "C" else work.max_tokens)
    seconds = min(s for s, _ in runs)
    return {"seconds": seconds, "run_seconds": [s for s, _ in runs], "tokens": counted,
            "tokens_per_s": counted / seconds, "first_tokens": runs[0][1][0][:FIRST_TOKENS]}


def run(engine_name: str, build, argv=None) -> None:
    """Entry point of a runner: build the engine, run one workload, print one JSON line."""
    args = parse_args(argv)
    work = WORKLOADS[args.workload]
    result = {"engine": engine_name, "dtype": args.dtype, "workload": work.name, "metric": work.metric}
    start = time.perf_counter()
    try:
        engine = build(args.model_path, args.dtype, args.threads)
    except Unsupported as exc:
        _emit({**result, "unsupported": str(exc)})
        return
    result["load_s"] = time.perf_counter() - start
    if work.name == "S":
        outs = engine.generate(workload_prompts(work), 1)
        result.update({"seconds": time.time() - args.t0 if args.t0 else None, "first_tokens": outs[0]})
    else:
        result.update(measure(engine, work))
    result["workload_spec"] = asdict(work)
    result["peak_rss_bytes"] = peak_rss_bytes()
    if hasattr(engine, "kv_pool_bytes"):
        result["kv_pool_bytes"] = engine.kv_pool_bytes()
    _emit(result)


def _status_kib(pid: int | str, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    """Live child processes of ``pid`` and theirs (an engine's worker processes, e.g. vLLM's engine core)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as children:
                    kids = [int(c) for c in children.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def peak_rss_bytes() -> int:
    """Peak resident memory (VmHWM) of this process plus that of each live descendant: the engine's
    high-water mark, counting file pages of mapped weights that were touched."""
    pid = os.getpid()
    return 1024 * sum(_status_kib(p, "VmHWM") for p in [pid, *_descendants(pid)])


def _emit(result: dict) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
