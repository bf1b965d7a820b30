"""Speculative decoding: speculation off vs each proposer (n-gram, self-draft, a draft model file),
on the default model, in interleaved rounds within one run (each round runs every configuration on
every workload, batch by batch, the configurations' order rotating), greedy.

Workloads: input-grounded chat prompts (rewrite or correct a given ~110-token passage, edit a given
code file: what to write is in the prompt) and open-ended ones (stories, questions), at batch 1 (three
prompts one after another) and batch 16, each answer ending at its end of text or max_tokens; and
workload B (64 requests x 128 random prompt tokens x 128 generated). Reports output tokens/s
(median over rounds), speed-up over speculation off, acceptance rate and mean accepted length;
prints a table and writes JSON.

    python benchmarks/speculative.py [--dtype float32] [--rounds 3] [--draft-model PATH]
    python benchmarks/speculative.py --rounds 1 --max-tokens 8 --workload-b 4x16x8   # a quick check
    python benchmarks/speculative.py --workloads grounded-b16 --configs self-q4_0    # one cell against off
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

import torch
from bench_results import add_output_arg, write_record

from kvmosaic import LLM, SamplingParams


class Workload(NamedTuple):
    batches: list[list[list[int]]]  # prompts (token ids), one generate call per batch
    out_len: int
    ignore_eos: bool
# Input-grounded tasks as a user sends them to the instruct model (chat template): the ~110-token
# passage or file to copy or edit is in the prompt, so the answer is mostly text the prompt holds.
PASSAGE = (
    "The river rose slowly through the night. By morning the lower streets were under water, and the baker, "
    "who had lived beside the bridge for forty years, carried his flour sacks up to the attic one by one. His "
    "neighbours came out in boats at noon. They passed bread and candles through the windows, and the children "
    "counted the ducks that swam where the market had stood the day before. When the water fell three days "
    "later, the streets were covered in mud, but the bakery opened again within a week, and the first loaves "
    "were given away.")
CODE = (
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
    "    return 2 * (width + height)\n\n\ndef scale(width, height, factor):\n"
    "    return width * factor, height * factor\n\n\ndef is_square(width, height):\n"
    "    return width == height\n\n\ndef describe(width, height):\n"
    "    kind = 'square' if is_square(width, height) else 'rectangle'\n"
    "    return f'{kind} of area {area(width, height)}'\n")
GROUNDED_TASKS = [
    f"Rewrite this passage in the past perfect tense:\n\n{PASSAGE}",
    f"Add a docstring to each function in this file and print the whole file:\n\n{CODE}",
    f"Fix the spelling in this text and return it in full:\n\n"
    f"{PASSAGE.replace('slowly', 'slowwly').replace('neighbours', 'nieghbours')}",
    f"Rename the parameter width to w everywhere in this code:\n\n{CODE}",
    f"Copy this passage exactly, word for word:\n\n{PASSAGE}",
]
OPEN_TASKS = ["Write a short story about a lighthouse keeper.", "Why is the sky blue?",
              "Tell me about the history of the bicycle.", "What should I cook for dinner tonight?",
              "Write a poem about autumn leaves.", "Explain how a rainbow forms.",
              "Describe a day in the life of a cat.", "What makes a good friend?"]


def _batch(prompts: list[list[int]], size: int) -> list[list[int]]:
    """size prompts cycling through the given ones (repeats differ by a trailing token)."""
    return [prompts[i % len(prompts)] + [198] * (i // len(prompts)) for i in range(size)]


def chat_prompts(llm: LLM, tasks: list[str]) -> list[list[int]]:
    return [llm.encode_chat([{"role": "user", "content": t}]) for t in tasks]


def workloads(llm: LLM, max_tokens: int, b_shape: tuple[int, int, int], vocab: int) -> dict[str, Workload]:
    """name -> its prompts run one batch at a time; prompt workloads stop at the end of the answer (or
    max_tokens), workload B's random prompts always generate their out_len tokens."""
    num, prompt_len, out_len = b_shape
    gen = torch.Generator().manual_seed(0)
    random_prompts = [torch.randint(100, vocab, (prompt_len,), generator=gen).tolist() for _ in range(num)]
    grounded, open_ended = chat_prompts(llm, GROUNDED_TASKS), chat_prompts(llm, OPEN_TASKS)
    return {"grounded-b1": Workload([[p] for p in grounded[:3]], max_tokens, False),
            "grounded-b16": Workload([_batch(grounded, 16)], max_tokens, False),
            "open-b1": Workload([[p] for p in open_ended[:3]], max_tokens, False),
            "open-b16": Workload([_batch(open_ended, 16)], max_tokens, False),
            f"B-{num}x{prompt_len}/{out_len}": Workload([random_prompts], out_len, True)}


def configurations(args) -> dict[str, dict | None]:
    k = args.k
    configs = {"off": None, "ngram": {"method": "ngram", "num_speculative_tokens": k}}
    for quantization in args.self_quantization.split(","):
        configs[f"self-{quantization}"] = {"method": "self", "num_speculative_tokens": k, "quantization": quantization}
    if args.draft_model:
        configs["draft"] = {"method": "draft", "model": args.draft_model, "num_speculative_tokens": k}
    return configs


def run_once(llm: LLM, batch: list[list[int]], load: Workload) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=load.out_len, ignore_eos=load.ignore_eos)
    llm.engine.reset_prefix_cache()
    before = llm.engine.stats()
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    delta = {key: after.get(key, 0) - before.get(key, 0)
             for key in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "tokens": tokens, **delta}


def run_round(llms: dict[str, LLM], order: list[str], load: Workload) -> dict[str, dict]:
    """One round of a workload: each batch runs under every configuration in turn before the next
    batch, so a slow phase of the host (its bandwidth swings by a third within minutes) falls on all
    configurations alike; a configuration's round sums its batches."""
    totals: dict[str, dict] = {name: {} for name in order}
    for batch in load.batches:
        for name in order:
            for key, value in run_once(llms[name], batch, load).items():
                totals[name][key] = totals[name].get(key, 0) + value
    return totals


def summarize(runs: list[dict]) -> dict:
    drafts, proposed, accepted = (sum(r[key] for r in runs) for key in
                                  ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"))
    return {"tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
            "acceptance": accepted / proposed if proposed else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None, help="the target's weight format (default: float)")
    parser.add_argument("--self-quantization", default="q8_0", help="the self-draft's weight formats, comma-separated")
    parser.add_argument("--draft-model", default=None, help="a draft model file with the target's tokenizer")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens of the prompt workloads")
    parser.add_argument("--workload-b", default="64x128x128", help="requests x prompt x output tokens")
    parser.add_argument("--workloads", default=None, help="comma-separated workload names (default: all)")
    parser.add_argument("--configs", default=None, help="comma-separated configurations (default: all; off is kept)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    add_output_arg(parser, "speculative")
    args = parser.parse_args()
    b_shape = tuple(int(x) for x in args.workload_b.split("x"))
    chosen = {name: spec for name, spec in configurations(args).items()
              if name == "off" or args.configs is None or name in args.configs.split(",")}
    llms = {name: LLM(dtype=args.dtype, quantization=args.quantization, kv_cache_memory=args.kv_cache_memory,
                      num_threads=args.threads, max_num_seqs=max(16, b_shape[0]), speculative=spec)
            for name, spec in chosen.items()}
    vocab = next(iter(llms.values())).engine.model_config.vocab_size
    loads = workloads(next(iter(llms.values())), args.max_tokens, b_shape, vocab)
    if args.workloads is not None:
        loads = {name: load for name, load in loads.items() if name in args.workloads.split(",")}
    for llm in llms.values():  # warm-up
        llm.generate(["Hello", "Why?"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    runs: dict[tuple[str, str], list[dict]] = {(w, c): [] for w in loads for c in llms}
    names = list(llms)
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for workload, load in loads.items():
            for name, run in run_round(llms, order, load).items():
                runs[workload, name].append(run)
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    results = []
    print(f"\n{'workload':<18}{'config':<12}{'tok/s':>9}{'speed-up':>10}{'accept':>9}{'mean len':>10}")
    for workload in loads:
        base = summarize(runs[workload, "off"])["tokens_per_s"]
        for name in names:
            row = summarize(runs[workload, name])
            row.update(workload=workload, config=name, speedup=row["tokens_per_s"] / base)
            results.append(row)
            accept = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "-"
            length = f"{row['mean_accepted_length']:.2f}" if row["mean_accepted_length"] is not None else "-"
            print(f"{workload:<18}{name:<12}{row['tokens_per_s']:>9.1f}{row['speedup']:>9.2f}x{accept:>9}{length:>10}")
    write_record("speculative", results, out=args.out, config={**vars(args), "configs": chosen})


if __name__ == "__main__":
    main()
