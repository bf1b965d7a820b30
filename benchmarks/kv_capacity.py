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

import torch
from bench_results import add_output_arg, write_record

from kvmosaic import LLM, SamplingParams
from kvmosaic.config import parse_memory_size

MODES = ("auto", "bf16", "int8", "int4", "oaken")


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def fill_prefix_cache(llm: LLM, prompts: list[list[int]]) -> None:
    """Prefill the prompts once, so the timed runs find their blocks cached and only decode."""
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))


def timed_decode(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of one run, counted from the first step in which every sequence decodes."""
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


def best_interleaved(llms: dict[str, LLM], prompts: dict[str, list[list[int]]], new_tokens: int,
                     repeats: int) -> dict[str, float]:
    """Best tokens/s per mode over ``repeats`` rounds; each round runs every mode once, so a slow
    phase of the machine hits all modes alike instead of one."""
    for mode, llm in llms.items():
        fill_prefix_cache(llm, prompts[mode])
    best = dict.fromkeys(llms, 0.0)
    for _ in range(repeats):
        for mode, llm in llms.items():
            best[mode] = max(best[mode], timed_decode(llm.engine, prompts[mode], new_tokens))
    return best


def make_llm(mode: str, args: argparse.Namespace) -> LLM:
    return LLM(dtype=args.dtype, kv_cache_memory=args.budget, kv_cache_dtype=mode, block_size=args.block_size,
               max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=args.seq_len + 16, swap_space=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="128MiB", help="KV memory budget of every mode")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per sequence (timed)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=0, help="cap the measured batch (0: the largest that fits)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--repeats", type=int, default=5, help="timed decode rounds per measurement (best kept)")
    add_output_arg(parser, "kv_capacity")
    args = parser.parse_args()
    parse_memory_size(args.budget)
    llms = {mode: make_llm(mode, args) for mode in args.modes}
    blocks_per_seq = -(-args.seq_len // args.block_size)
    prompt_len = args.seq_len - args.new_tokens
    vocab = llms[args.modes[0]].engine.model_config.vocab_size
    rows = {}
    for mode, llm in llms.items():
        cache = llm.engine.executor.worker.kv_cache
        max_batch = cache.num_blocks // blocks_per_seq
        rows[mode] = {"mode": mode, "bits_per_value": cache.bits_per_value, "bytes_per_block": cache.bytes_per_block,
                      "num_blocks": cache.num_blocks, "max_batch": max_batch,
                      "batch": min(max_batch, args.max_batch) if args.max_batch else max_batch}
    preempted = {mode: llm.engine.stats()["num_preemptions"] for mode, llm in llms.items()}
    at_max = best_interleaved(llms, {m: prompts_for(rows[m]["batch"], prompt_len, vocab) for m in llms},
                              args.new_tokens, args.repeats)
    equal = rows[args.modes[0]]["batch"]
    at_equal = best_interleaved(llms, dict.fromkeys(llms, prompts_for(equal, prompt_len, vocab)), args.new_tokens,
                                args.repeats)
    for mode, llm in llms.items():
        rows[mode].update(tok_s=at_max[mode], equal_batch=equal, equal_tok_s=at_equal[mode],
                          preemptions=llm.engine.stats()["num_preemptions"] - preempted[mode])
        print(json.dumps(rows[mode]), flush=True)
    base = rows[args.modes[0]]
    print(f"\nKV budget {args.budget}, {args.seq_len}-token sequences ({args.new_tokens} decoded), dtype {args.dtype}, "
          f"best of {args.repeats} interleaved rounds")
    print("| kv_cache_dtype | bits/value | blocks | max batch | decode tok/s at max batch | "
          f"decode tok/s at batch {equal} | vs {base['mode']} at equal batch | preemptions |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows.values():
        print(f"| {r['mode']} | {r['bits_per_value']:.2f} | {r['num_blocks']} | {r['max_batch']} | {r['tok_s']:.1f} | "
              f"{r['equal_tok_s']:.1f} | {r['equal_tok_s'] / base['equal_tok_s']:.2f}x | {r['preemptions']} |")
    write_record("kv_capacity", list(rows.values()), out=args.out, config=vars(args))


if __name__ == "__main__":
    main()
