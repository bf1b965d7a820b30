"""KV capacity and decode speed per KV-cache format under one memory budget.

For each of auto / int8 / int4 / oaken: the number of blocks the budget buys, the largest batch of
``--seq-len``-token sequences that fits without preemption, and decode throughput both at that
batch and at the batch ``auto`` fits (equal batch: the cost of quantizing and dequantizing).
Prompts are prefilled once (prefix caching keeps their blocks), then the timed run only decodes.

    HF_HUB_OFFLINE=1 nice -n 19 .venv/bin/python benchmarks/kv_capacity.py --budget 128MiB
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvmosaic import LLM, SamplingParams
from kvmosaic.config import parse_memory_size

MODES = ("auto", "int8", "int4", "oaken")


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def decode_throughput(llm: LLM, batch: int, prompt_len: int, new_tokens: int, repeats: int = 1) -> tuple[float, int]:
    """(decode tokens/s with every sequence decoding, best of ``repeats`` runs; preemptions during the runs)."""
    engine = llm.engine
    prompts = prompts_for(batch, prompt_len, engine.model_config.vocab_size)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))  # fill the prefix cache
    before = engine.stats()["num_preemptions"]
    best = max(_timed_decode(engine, prompts, new_tokens) for _ in range(repeats))
    return best, engine.stats()["num_preemptions"] - before


def _timed_decode(engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    produced = dict.fromkeys(ids, 0)
    start, timed_tokens = None, 0
    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            if out.request_id in produced:
                produced[out.request_id] = len(out.outputs[0].token_ids)
        if start is None and all(produced.values()):
            start = time.perf_counter()  # from here on every step is a pure decode step
            timed_tokens = -sum(produced.values())
    elapsed = time.perf_counter() - start
    timed_tokens += sum(produced.values())
    return timed_tokens / elapsed


def run_mode(mode: str, args: argparse.Namespace, equal_batch: int | None) -> dict:
    blocks_per_seq = -(-args.seq_len // args.block_size)
    llm = LLM(dtype=args.dtype, kv_cache_memory=args.budget, kv_cache_dtype=mode, block_size=args.block_size,
              max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=args.seq_len + 16, swap_space=0)
    cache = llm.engine.kv_cache
    max_batch = cache.num_blocks // blocks_per_seq
    prompt_len = args.seq_len - args.new_tokens
    row = {"mode": mode, "bits_per_value": cache.bits_per_value, "bytes_per_block": cache.bytes_per_block,
           "num_blocks": cache.num_blocks, "max_batch": max_batch}
    batch = min(max_batch, args.max_batch) if args.max_batch else max_batch
    row["batch"] = batch
    row["tok_s"], row["preemptions"] = decode_throughput(llm, batch, prompt_len, args.new_tokens, args.repeats)
    if equal_batch is not None:
        row["equal_batch"] = equal_batch
        row["equal_tok_s"], _ = decode_throughput(llm, equal_batch, prompt_len, args.new_tokens, args.repeats)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="128MiB", help="KV memory budget of every mode")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per sequence (timed)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=0, help="cap the measured batch (0: the largest that fits)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--repeats", type=int, default=3, help="timed decode runs per measurement (best kept)")
    parser.add_argument("--out", default="benchmarks/results/kv_capacity.json")
    args = parser.parse_args()
    parse_memory_size(args.budget)
    rows = [run_mode(args.modes[0], args, None)]
    equal = rows[0]["batch"]
    rows[0].update(equal_batch=equal, equal_tok_s=rows[0]["tok_s"])
    rows += [run_mode(mode, args, equal) for mode in args.modes[1:]]
    base = rows[0]
    print(f"\nKV budget {args.budget}, {args.seq_len}-token sequences ({args.new_tokens} decoded), dtype {args.dtype}")
    print("| kv_cache_dtype | bits/value | blocks | max batch | decode tok/s at max batch | "
          f"decode tok/s at batch {equal} | vs {base['mode']} at equal batch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['bits_per_value']:.2f} | {r['num_blocks']} | {r['max_batch']} | {r['tok_s']:.1f} | "
              f"{r['equal_tok_s']:.1f} | {r['equal_tok_s'] / base['equal_tok_s']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
