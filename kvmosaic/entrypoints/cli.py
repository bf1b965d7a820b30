"""``kvmosaic`` command line: generate, chat, serve, plan, calibrate-kv, eval-ppl."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvmosaic.config import WEIGHT_QUANTIZATIONS, parse_memory_size
from kvmosaic.entrypoints.llm import LLM
from kvmosaic.eval import cli as eval_cli
from kvmosaic.planner import cli as plan_cli
from kvmosaic.quant.format import KV_CACHE_DTYPES
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.spec.config import SpeculativeConfig, SpeculativeConfigError

if TYPE_CHECKING:
    from kvmosaic.entrypoints.openai.api_server import ServerConfig


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype; auto = bfloat16 on CPUs with AVX512-BF16, else float32")
    p.add_argument("--quantization", default="auto", choices=WEIGHT_QUANTIZATIONS,
                   help="weight format: auto (a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices run natively, an HF "
                        "directory stays float), none (every weight dequantized to --dtype), or q8_0 / q4_0 / "
                        "q4_1 / q4_k / q6_k (quantized at load)")
    p.add_argument("--kv-cache-memory", default="auto",
                   help="KV pool size such as 2GiB; auto: profile, then take a share of the RAM still available")
    p.add_argument("--kv-cache-prefault", action="store_true",
                   help="make the whole KV pool resident at start (default: page by page as blocks are first "
                        "written)")
    p.add_argument("--memory-utilization", type=float, default=0.5,
                   help="with --kv-cache-memory auto: the share of available RAM the KV pool may take")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (compute dtype), int8, int4 or oaken")
    p.add_argument("--kv-thresholds", default=None,
                   help="Oaken thresholds from `kvmosaic calibrate-kv` (default: shipped for the default model)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="forward passes a decode-only step runs before scheduling again (multi-step decoding)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (adaptive k unless "adaptive": false)')


def _speculative_config(value: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(value)
    except SpeculativeConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop, max_tokens=args.max_tokens,
    )


def _make_llm(args: argparse.Namespace, **engine_kwargs) -> LLM:
    return LLM(model=args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_memory=args.kv_cache_memory,
               memory_utilization=args.memory_utilization, block_size=args.block_size, max_model_len=args.max_model_len,
               enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
               kv_cache_dtype=args.kv_cache_dtype, kv_thresholds=args.kv_thresholds,
               kv_cache_prefault=args.kv_cache_prefault, speculative=args.speculative_config,
               num_scheduler_steps=args.num_scheduler_steps, **engine_kwargs)


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
    llm = _make_llm(args, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    instances=args.instances, ray_address=args.ray_address, enable_borrowing=not args.no_borrowing,
                    cluster_secret_file=args.cluster_secret_file,
                    prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                    kv_transfer_dtype=args.kv_transfer_dtype, max_worker_restarts=args.max_worker_restarts)
    try:
        return run_server(llm.engine, config)
    finally:
        llm.shutdown()


def server_config(args: argparse.Namespace) -> ServerConfig:
    from kvmosaic.entrypoints.openai.api_keys import collect_api_keys
    from kvmosaic.entrypoints.openai.api_server import ServerConfig
    from kvmosaic.entrypoints.openai.http_limits import HttpLimits

    limits = HttpLimits(max_body_bytes=parse_memory_size(args.max_body_size), body_timeout=args.body_timeout,
                        header_timeout=args.header_timeout, keep_alive_timeout=args.keep_alive_timeout,
                        max_connections_per_client=args.max_connections_per_client)
    return ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        max_waiting=args.max_waiting, max_n=args.max_n, shutdown_grace=args.shutdown_grace,
                        log_level=args.log_level, access_log=args.access_log,
                        api_keys=collect_api_keys(args.api_key, args.api_key_file), metrics_public=args.metrics_public,
                        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, limits=limits)


def _add_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=[],
                   help="a key clients must send as 'Authorization: Bearer <key>' (repeatable; also read from "
                        "KVMOSAIC_API_KEY); /health stays open")
    p.add_argument("--api-key-file", default=None, help="a file of API keys, one a line")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without an API key")
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM); with --ssl-certfile: HTTPS")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    p.add_argument("--max-body-size", default="4MiB", help="largest request body (413 beyond it)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive (408 beyond it)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's head before it is closed")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, help="seconds an idle connection stays open")
    p.add_argument("--max-connections-per-client", type=int, default=256,
                   help="open connections one client address may hold (0: no cap)")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: derived)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="sequences in one running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for their first token; beyond it new requests get 503")
    p.add_argument("--max-n", type=int, default=16, help="largest n / best_of a request may ask for")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--instances", type=int, default=1,
                   help="engine instances as Ray actors lending each other KV blocks (each gets --kv-cache-memory)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting a local runtime")
    p.add_argument("--cluster-secret-file", default=None,
                   help="with --instances: the data plane's shared secret (hex or text) for instances started "
                        "apart (else KVMOSAIC_CLUSTER_SECRET; neither: a new one per run)")
    p.add_argument("--no-borrowing", action="store_true", help="with --instances: never borrow blocks across instances")
    p.add_argument("--prefill-workers", type=int, default=0,
                   help="disaggregated serving: prefill workers as Ray actors (with --decode-workers)")
    p.add_argument("--decode-workers", type=int, default=0,
                   help="disaggregated serving: decode workers as Ray actors; prompts' K/V moves to them")
    p.add_argument("--kv-transfer-dtype", default="auto", choices=["auto", "int8"],
                   help="disaggregated serving: send a float cache's prompt K/V as int8 records (~4x fewer bytes "
                        "than float32) instead of as the cache holds it")
    p.add_argument("--max-worker-restarts", type=int, default=3,
                   help="with --instances or --prefill/--decode-workers: times an actor that died or hung is "
                        "replaced (per worker, within 10 minutes; 0: a lost one stays lost)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmosaic", description="KV-cache-centric LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt, streaming tokens to stdout")
    gen.add_argument("prompt")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming)")
    _add_engine_args(serve)
    _add_serve_args(serve)
    _add_security_args(serve)
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
