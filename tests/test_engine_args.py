"""Options declared once (EngineArgs, ServerArgs): the command line and LLM() are generated from them,
with the same defaults, and both build their configs through EngineArgs.create_engine_configs."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re

import pytest

from kvmosaic.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvmosaic.engine_args import EngineArgs, EngineConfigs
from kvmosaic.entrypoints import llm as llm_module
from kvmosaic.entrypoints.cli import build_parser
from kvmosaic.entrypoints.llm import LLM
from kvmosaic.entrypoints.server_args import ServerArgs
from kvmosaic.options import add_options, check_keywords, from_namespace, option
from kvmosaic.sampling_params import SamplingParams


def _llm_options() -> dict[str, inspect.Parameter]:
    params = dict(inspect.signature(LLM).parameters)
    del params["model_loader"]  # a Python object (the weights reader), not an option
    return params


def _help_defaults(capsys, monkeypatch, command: list[str]) -> dict[str, str | None]:
    """Flag -> the "(default: ...)" its line of ``kvmosaic <command> --help`` shows (None: none shown)."""
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    entries = re.split(r"\n  (?=-)", capsys.readouterr().out)  # an option's flags, then its help
    shown = {}
    for entry in entries[1:]:
        default = re.search(r"\(default: ([^()]*)\)\s*$", entry.split("\n\n")[0])
        shown[entry.split()[0].rstrip(",")] = default.group(1) if default else None
    return shown


def test_serve_help_lists_every_llm_option_with_its_default(capsys, monkeypatch):
    options = _llm_options()
    assert list(options) == [f.name for f in dataclasses.fields(EngineArgs)]
    shown = _help_defaults(capsys, monkeypatch, ["serve"])
    parsed = build_parser().parse_args(["serve"])
    for name, param in options.items():
        flag = "--" + name.replace("_", "-")
        assert flag in shown, f"serve --help does not list {flag}"
        assert getattr(parsed, name) == param.default, name
        if isinstance(param.default, bool):
            assert shown[flag] == ("on" if param.default else "off"), flag
        elif param.default is not None:
            assert shown[flag] == str(param.default), flag
    assert shown["--max-model-len"] == "8192" and shown["--preemption-mode"] == "recompute"
    assert shown["--swap-space"] == "1GiB"


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
def test_generate_and_chat_take_the_engine_options(command):
    parsed = build_parser().parse_args([*command, "--max-model-len", "512", "--preemption-mode", "swap"])
    args = from_namespace(EngineArgs, parsed)
    assert (args.max_model_len, args.preemption_mode, args.seed) == (512, "swap", 0)
    seeded = build_parser().parse_args([*command, "--seed", "7"])
    assert seeded.sampling_seed == 7 and from_namespace(EngineArgs, seeded).seed == 0  # --seed is the request's


def test_an_unknown_llm_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"'max_model_length'.*did you mean 'max_model_len'"):
        LLM(max_model_length=1024)
    with pytest.raises(TypeError, match="'no_such_option'"):
        LLM(no_such_option=1)
    with pytest.raises(TypeError, match="'model_loader'"):
        LLM(model_loadr=None)


def test_default_options_build_the_configs_defaults(monkeypatch):
    """The configs' own defaults are the options' defaults: nothing to drift."""
    assert EngineArgs().create_engine_configs() == EngineConfigs(EngineConfig())
    assert EngineConfig().cache == CacheConfig() and SchedulerConfig().max_model_len == EngineArgs().max_model_len
    from kvmosaic.entrypoints.openai.api_server import ServerConfig

    monkeypatch.delenv("KVMOSAIC_API_KEY", raising=False)
    assert ServerArgs().to_server_config() == ServerConfig()


ROUND_TRIPS = [
    (["--preemption-mode", "swap", "--swap-space", "2GiB", "--max-model-len", "1024", "--block-size", "32",
      "--no-prefix-caching", "--kv-cache-memory", "64MiB", "--threads", "1", "--num-scheduler-steps", "2"],
     {"preemption_mode": "swap", "swap_space": "2GiB", "max_model_len": 1024, "block_size": 32,
      "enable_prefix_caching": False, "kv_cache_memory": "64MiB", "num_threads": 1, "num_scheduler_steps": 2}),
    (["--swap-space", "0", "--kv-cache-dtype", "int8", "--kv-group-size", "32", "--num-blocks", "64",
      "--speculative-config", '{"num_speculative_tokens": 3}', "--quantization", "none", "--dtype", "float32"],
     {"swap_space": 0, "kv_cache_dtype": "int8", "kv_group_size": 32, "num_blocks": 64,
      "speculative": {"num_speculative_tokens": 3}, "quantization": "none", "dtype": "float32"}),
    (["--instances", "2", "--no-borrowing", "--max-worker-restarts", "0", "--kv-cache-prefault"],
     {"instances": 2, "enable_borrowing": False, "max_worker_restarts": 0, "kv_cache_prefault": True}),
    (["--prefill-workers", "1", "--decode-workers", "2", "--kv-transfer-dtype", "int8"],
     {"prefill_workers": 1, "decode_workers": 2, "kv_transfer_dtype": "int8"}),
]


@pytest.mark.parametrize(("flags", "kwargs"), ROUND_TRIPS)
def test_flags_and_llm_keywords_build_the_same_configs(monkeypatch, flags, kwargs):
    built = []
    monkeypatch.setattr(llm_module, "build_engine", lambda *configs: built.append(configs))
    LLM(**kwargs)
    from_cli = from_namespace(EngineArgs, build_parser().parse_args(["serve", *flags])).create_engine_configs()
    assert from_cli == EngineArgs(**kwargs).create_engine_configs()
    engine, distributed, loader, disagg = built[0]
    assert EngineConfigs(engine, distributed, disagg) == from_cli and loader is None
    assert from_cli != EngineArgs().create_engine_configs()


def test_the_options_reach_the_configs(monkeypatch):
    configs = from_namespace(EngineArgs, build_parser().parse_args(
        ["serve", "--preemption-mode", "swap", "--swap-space", "2GiB", "--instances", "2"])).create_engine_configs()
    assert configs.engine.scheduler.preemption_mode == "swap" and configs.engine.uses_host_tier
    assert configs.engine.cache.swap_space == 2 * 1024**3
    assert configs.distributed.num_instances == 2 and configs.disagg is None
    spec = EngineArgs(speculative='{"method": "ngram"}').create_engine_configs().engine.speculative
    assert spec == SpeculativeConfig()


@pytest.mark.parametrize(("flags", "message"), [
    (["--swap-space", "lots"], "invalid memory size"),
    (["--kv-cache-memory=-1GiB"], "--kv-cache-memory: invalid memory size"),
    (["--preemption-mode", "never"], "invalid choice"),
    (["--speculative", '{"method": "nope"}'], "method must be one of"),
    (["--max-model-len", "long"], "invalid int value"),
])
def test_bad_flags_exit_with_a_message(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"preemption_mode": "never"}, "preemption_mode"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"instances": 0}, "instances"),
    ({"instances": 2, "prefill_workers": 1}, "not both"),
    ({"speculative": {"method": "ngram"}, "num_scheduler_steps": 2}, "cannot be combined"),
])
def test_bad_options_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_engine_configs()


def test_configs_and_sampling_params_are_frozen():
    model = ModelConfig("llama", 64, 64, 128, 2, 4, 2)
    params = SamplingParams(stop="\n", top_k=-1)
    for obj, name, value in [(model, "max_position_embeddings", 4096), (model, "eos_token_ids", (1,)),
                             (params, "max_tokens", 3), (params, "temperature", 0.0),
                             (EngineArgs(), "max_model_len", 1), (EngineConfig(), "seed", 1)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, value)
    assert model.head_dim == 16 and params.stop == ("\n",) and params.top_k == 0
    assert dataclasses.replace(model, max_position_embeddings=4096).head_dim == 16
    assert dataclasses.replace(params, max_tokens=3).max_tokens == 3
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(params, temperature=-1.0)  # a changed copy is validated again


@dataclasses.dataclass(frozen=True)
class _Demo:
    fast: bool = option(True, flags=("--quick", "--no-quick"), help="go fast")
    tags: tuple[str, ...] = option((), help="repeatable")
    limit: int | None = option(None, help="a limit")
    ratio: float = option(0.5, help="a ratio with 50% of things")


def _demo(argv: list[str]) -> _Demo:
    parser = argparse.ArgumentParser()
    add_options(parser, _Demo, "demo")
    return from_namespace(_Demo, parser.parse_args(argv))


def test_flags_follow_the_field_types():
    assert _demo([]) == _Demo()
    assert _demo(["--no-fast", "--tags", "a", "--tags", "b", "--limit", "3", "--ratio", "0.25"]) == _Demo(
        fast=False, tags=("a", "b"), limit=3, ratio=0.25)
    assert not _demo(["--no-quick"]).fast and _demo(["--no-quick", "--quick"]).fast
    assert _demo([]).tags == () and _demo(["--tags", "x"]).tags == ("x",)  # the default is not shared


def test_an_option_needs_a_help_text_and_a_parsable_type():
    @dataclasses.dataclass(frozen=True)
    class Plain:
        x: int = 0

    @dataclasses.dataclass(frozen=True)
    class Opaque:
        x: dict | None = option(None, help="no parser for a dict")

    for cls, message in [(Plain, "option"), (Opaque, "parse")]:
        with pytest.raises(TypeError, match=message):
            add_options(argparse.ArgumentParser(), cls, "bad")
    with pytest.raises(TypeError, match="'fats'.*'fast'"):
        check_keywords(_Demo, {"fats": True}, "demo()")
