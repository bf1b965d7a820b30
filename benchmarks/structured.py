"""Structured output: JSON-schema generation for a batch of requests, constrained against
unconstrained decoding, with jump-forward on and off, and the share of the time spent in grammar
work (llguidance masks, forced tokens, completion checks).

Two schemas: "short keys" (three short property names) and "long keys" (five long property names
with enum and boolean values, so most of the output is forced by the grammar). Each round runs
every mode on the same prompts back to back (interleaved, so a slow phase of the host falls on all
of them); tokens/s is output tokens over wall time, the median over rounds. The unconstrained mode
generates as many tokens per request as the constrained one did (ignore_eos), so both decode the
same number of tokens.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/structured.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench_results import add_output_arg, write_record

from kvmosaic import SamplingParams
from kvmosaic.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmosaic.engine.engine import Engine
from kvmosaic.executor.local import LocalExecutor
from kvmosaic.ops.cpu import isa_summary
from kvmosaic.structured import GuidedDecoding
from kvmosaic.structured.grammar_guide import GuideFactory

NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "Dev Patel", "Emma Weber", "Farid Haddad", "Grace Kim",
         "Hugo Silva", "Ines Moreau", "Jonas Berg", "Keiko Sato", "Liam Walsh", "Maya Cohen", "Nils Olsen",
         "Olga Petrova", "Pablo Ruiz"]
SCHEMAS = {
    "short keys": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"]},
    "long keys": {"type": "object", "properties": {
        "customer_full_legal_name_as_written_on_passport": {"type": "string", "maxLength": 24},
        "customer_has_agreed_to_the_terms_and_conditions": {"type": "boolean"},
        "customer_preferred_contact_channel_for_notifications": {"enum": ["email", "telephone", "postal_mail"]},
        "customer_account_tier_in_the_loyalty_programme": {"enum": ["bronze", "silver", "gold", "platinum"]},
        "customer_is_subscribed_to_the_monthly_newsletter": {"type": "boolean"}},
        "required": ["customer_full_legal_name_as_written_on_passport",
                     "customer_has_agreed_to_the_terms_and_conditions",
                     "customer_preferred_contact_channel_for_notifications",
                     "customer_account_tier_in_the_loyalty_programme",
                     "customer_is_subscribed_to_the_monthly_newsletter"]},
}


class TimedGuides(GuideFactory):
    """The engine's guide factory, timing every call into the grammar; ``jump_forward`` switches it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = 0.0
        self.jump_forward = True

    def start(self, guided, jump_forward=True):
        guide = super().start(guided, jump_forward and self.jump_forward)
        return _Timed(guide, self) if guided is not None else guide


class _Timed:
    def __init__(self, guide, clock: TimedGuides) -> None:
        self.guide, self.clock = guide, clock

    def _time(self, name, *args):
        start = time.perf_counter()
        try:
            return getattr(self.guide, name)(*args)
        finally:
            self.clock.seconds += time.perf_counter() - start

    def masks(self, outputs, proposals):
        return self._time("masks", outputs, proposals)

    def num_valid(self, outputs, proposals):
        return self._time("num_valid", outputs, proposals)

    def forced(self, outputs):
        return self._time("forced", outputs)

    def complete(self, outputs):
        return self._time("complete", outputs)

    def fork(self):
        return _Timed(self.guide.fork(), self.clock)


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    guides: TimedGuides = engine.guides
    guides.seconds = 0.0
    engine.reset_prefix_cache()
    start = time.perf_counter()
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params, strict=True)]
    outputs, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    seconds = time.perf_counter() - start
    texts = [outputs[i].text for i in ids]
    return {"seconds": seconds, "steps": steps, "grammar_seconds": guides.seconds,
            "tokens": sum(len(outputs[i].token_ids) for i in ids), "lengths": [len(outputs[i].token_ids) for i in ids],
            "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    add_output_arg(parser, "structured")
    args = parser.parse_args()
    config = EngineConfig(num_threads=args.threads, cache=CacheConfig(kv_cache_memory="512MiB"),
                          scheduler=SchedulerConfig(max_num_seqs=max(16, args.batch)))
    executor = LocalExecutor(config)
    engine = Engine(config, executor, guides=TimedGuides(executor.tokenizer, executor.model_config.vocab_size))
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content":
               f"Write a JSON record for the customer {NAMES[i % len(NAMES)]}."}])) for i in range(args.batch)]
    run(engine, prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2)  # warm-up
    rows, runs = [], {}
    for schema_name, schema in SCHEMAS.items():
        guided = SamplingParams(temperature=0, max_tokens=args.max_tokens, guided_decoding=GuidedDecoding(json=schema))
        engine.guides.compile(guided.guided_decoding)  # compiled once, cached by schema
        for round_index in range(args.rounds):
            engine.guides.jump_forward = True
            on = run(engine, prompts, [guided] * args.batch)
            free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in on["lengths"]]
            order = [("constrained, jump-forward", True), ("constrained", False), ("unconstrained", None)]
            order = order[round_index % 3:] + order[:round_index % 3]
            for mode, jump in order:
                if jump is None:
                    result = run(engine, prompts, free)
                elif jump:
                    result = on if round_index == 0 else run(engine, prompts, [guided] * args.batch)
                else:
                    engine.guides.jump_forward = False
                    result = run(engine, prompts, [guided] * args.batch)
                    engine.guides.jump_forward = True
                for text in result["texts"] if jump is not None else []:
                    json.loads(text)  # every constrained output parses
                runs.setdefault((schema_name, mode), []).append(result)
            print(f"{schema_name}: round {round_index + 1}/{args.rounds} done", flush=True)
    print(f"\nhost: {isa_summary()}, {args.threads} threads, batch {args.batch}, default model (Q4_1 weights)")
    print(f"{'schema':<12}{'mode':<28}{'tokens':>8}{'steps':>7}{'tok/s':>9}{'vs free':>9}{'grammar':>9}")
    for schema_name in SCHEMAS:
        base = statistics.median(r["tokens"] / r["seconds"] for r in runs[schema_name, "unconstrained"])
        for mode in ("unconstrained", "constrained", "constrained, jump-forward"):
            results = runs[schema_name, mode]
            rate = statistics.median(r["tokens"] / r["seconds"] for r in results)
            share = statistics.median(r["grammar_seconds"] / r["seconds"] for r in results)
            row = {"schema": schema_name, "mode": mode, "tokens": results[0]["tokens"], "steps": results[0]["steps"],
                   "tokens_per_s": rate, "vs_unconstrained": rate / base, "grammar_share": share,
                   "runs": [{k: v for k, v in r.items() if k != "texts"} for r in results],
                   "sample_output": results[0]["texts"][0]}
            rows.append(row)
            print(f"{schema_name:<12}{mode:<28}{row['tokens']:>8}{row['steps']:>7}{rate:>9.1f}"
                  f"{row['vs_unconstrained']:>8.2f}x{100 * share:>8.1f}%")
    write_record("structured", rows, out=args.out, config={**vars(args), "schemas": SCHEMAS})


if __name__ == "__main__":
    main()
