"""``kvmosaic`` command line: generate, chat, serve, plan, calibrate-kv, eval-ppl."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvmosaic.engine_args import EngineArgs
from kvmosaic.entrypoints.llm import LLM
from kvmosaic.entrypoints.server_args import ServerArgs
from kvmosaic.eval import cli as eval_cli
from kvmosaic.options import add_options, from_namespace
from kvmosaic.planner import cli as plan_cli
from kvmosaic.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvmosaic.entrypoints.openai.api_server import ServerConfig


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, dest="sampling_seed", help="the request's seed")
    p.add_argument("--stop", action="append", default=[])


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.sampling_seed, stop=args.stop,
        max_tokens=args.max_tokens,
    )


def _make_llm(args: argparse.Namespace) -> LLM:
    return LLM(**from_namespace(EngineArgs, args).as_kwargs())  # bad options fail before the model loads


def stream(llm: LLM, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Yield text deltas of one request as the engine produces them."""
    engine = llm.engine
    request_id = engine.add_request(None, prompt, params)
    sent = 0
    try:
        while True:
            for out in engine.step():
                if out.request_id != request_id or not out.outputs:
                    continue
                text = out.outputs[0].text
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
                if out.finished:
                    return
    finally:
        engine.abort(request_id)


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # bad sampling options fail before the model loads
    llm = _make_llm(args)
    sys.stdout.write(args.prompt)
    for delta in stream(llm, args.prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # bad sampling options fail before the model loads
    llm = _make_llm(args)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("kvmosaic chat: type a message, or /exit to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(messages, True)
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        reply = []
        for delta in stream(llm, ids, params):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvmosaic.entrypoints.openai.api_server import run_server  # fastapi only when serving

    config = server_config(args)  # bad server options fail before the model loads
    llm = _make_llm(args)
    try:
        return run_server(llm.engine, config)
    finally:
        llm.shutdown()


def server_config(args: argparse.Namespace) -> ServerConfig:
    return from_namespace(ServerArgs, args).to_server_config()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmosaic", description="KV-cache-centric LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt, streaming tokens to stdout")
    gen.add_argument("prompt")
    add_options(gen, EngineArgs, "engine options", exclude=["seed"])  # --seed is the request's
    _add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    add_options(chat, EngineArgs, "engine options", exclude=["seed"])
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming)")
    add_options(serve, EngineArgs, "engine options")
    add_options(serve, ServerArgs, "server options")
    serve.set_defaults(func=cmd_serve)
    plan = sub.add_parser("plan", help="roofline capacity planner: memory, step time and tokens/s per batch size")
    plan_cli.add_arguments(plan)
    plan.set_defaults(func=plan_cli.cmd_plan)
    calibrate = sub.add_parser("calibrate-kv", help="Oaken offline profiling: per-layer K/V thresholds file")
    eval_cli.add_calibrate_arguments(calibrate)
    calibrate.set_defaults(func=eval_cli.cmd_calibrate)
    ppl = sub.add_parser("eval-ppl", help="perplexity of a text with the KV cache in a chosen format")
    eval_cli.add_eval_arguments(ppl)
    ppl.set_defaults(func=eval_cli.cmd_eval_ppl)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
