"""Shared fixtures. The expensive ones are session-scoped: load each model once per run."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path
from unittest import mock

# Must precede any transformers / huggingface_hub import: tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Engines started by the tests keep their repacked-weight cache (kvmosaic/model/weight_cache.py) in a
# directory of this run's own, never in the user's cache.
if "KVMOSAIC_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["KVMOSAIC_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvmosaic-test-cache-")
    atexit.register(shutil.rmtree, os.environ["KVMOSAIC_CACHE_DIR"], ignore_errors=True)

# The tests mirror the package's folders; a test module may use another's helpers by its name
# (``from test_disagg_server import body``) and the shared helper modules at this level, wherever it sits.
sys.path.extend(str(folder) for folder in sorted(Path(__file__).parent.rglob("*"))
                if folder.is_dir() and not folder.name.startswith((".", "__")))

import pytest
import torch
from hypothesis import settings
from kernel_levels import levels_under_test

from kvmosaic.model import loader
from kvmosaic.model.loader import LoadedModel, load_model
from kvmosaic.ops import Kernels

# CI (the CI environment variable set) replays the same generated examples on every run, so a
# result does not depend on the draw; local runs keep exploring new examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session", params=levels_under_test())
def level_kernels(request) -> Kernels:
    """The C++ kernels of each ISA level built on this host (AVX-512, AVX2, portable, ...): a kernel
    test taking this fixture runs once per level, so an AVX-512 host also checks the AVX2 build. No
    level built: the tests are skipped (empty parameter set)."""
    return Kernels.load(request.param)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF."""
    return loader.default_model_path()


@pytest.fixture(scope="session")
def default_model(default_model_path: str) -> LoadedModel:
    """The default model loaded by our loader in float32, every weight dequantized (the float path
    HF parity is checked on). Shared: do not mutate its weights."""
    return load_model(default_model_path, torch.float32, quantization=None)


@pytest.fixture(scope="session")
def hf_gguf_model(default_model_path: str):
    """transformers' float32 dequantization of the same GGUF (about 10 s to load), in eval mode."""
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(default_model_path)
    with _gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval()


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF twice (config, then weights; ~5 s each here, most of it the
    tokenizer's 49k-entry arrays) and rebuilds gguf's tensor-name map once per module (~400 times).
    Both are read-only: reuse one reader per file and one map per (architecture, layers) while
    the model loads. The weights and their dequantization stay transformers' and gguf's own."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[str, object] = {}

    def reader(path, *args, **kwargs):
        if args or kwargs:
            return original(path, *args, **kwargs)
        key = os.fspath(path)
        if key not in readers:
            readers[key] = original(path)
        return readers[key]

    with mock.patch.object(gguf, "GGUFReader", reader), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


@pytest.fixture(scope="session")
def cached_loader(default_model: LoadedModel):
    """A model loader that reuses loaded weights instead of re-reading the GGUF: pass it to engines
    as ``LLM(model_loader=...)`` / ``LocalExecutor(config, loader)``."""
    cache: dict[tuple, LoadedModel] = {(None, torch.float32): default_model}

    def load(path, dtype=torch.float32):
        key = (path, dtype)
        if key not in cache:
            cache[key] = load_model(path, dtype, quantization=None)
        return cache[key]

    return load


def _start_local_ray() -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 1024**2)


@pytest.fixture(scope="session")
def restart_local_ray():
    """Starts the session's local Ray runtime again (for a test that stopped it to join another cluster)."""
    return _start_local_ray


@pytest.fixture(scope="session")
def ray_runtime():
    """One local Ray runtime for the whole test session."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        _start_local_ray()
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def server(cached_loader):
    """The OpenAI-compatible server over a float32 default-model engine, in a thread of this process
    (one per test module; a module may define its own)."""
    from kvmosaic import LLM
    from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig

    engine = LLM(dtype="float32", kv_cache_memory="128MiB", model_loader=cached_loader).engine
    with BackgroundServer(engine, ServerConfig(port=0, shutdown_grace=1.0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    """The real ``openai`` client of ``server``."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


# `make test-fast` runs the suite minus these (`-m "not heavy"`), with the kernels of the best level
# only (kernel_levels.py): the end-to-end tests on the full default model (marked slow, or using a
# fixture that runs it) and the modules that start other processes (Ray clusters, servers in a
# subprocess). `make test` and CI run everything.
MULTI_PROCESS_MODULES = frozenset({
    "test_disagg_ray", "test_disagg_server", "test_distributed_cluster", "test_distributed_nodes",
    "test_distributed_quant", "test_supervision", "test_server_shutdown",
})


# the fixtures that run the whole default model (an engine or server on it, transformers' copy of it)
FULL_MODEL_FIXTURES = frozenset({"default_model", "hf_gguf_model", "cached_loader", "server", "client"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.get_closest_marker("slow") or item.module.__name__.rpartition(".")[2] in MULTI_PROCESS_MODULES
                or FULL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.heavy)
