"""The worker's start-up phases (weights -> memory -> KV cache and backend) and a worker assembled from
their results around a wrapped backend, as a distributed instance assembles one."""

from __future__ import annotations

import pytest

from kvmosaic.attention.backend import AttentionBackend
from kvmosaic.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmosaic.engine.engine import Engine
from kvmosaic.executor.local import LocalExecutor
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.worker import startup
from kvmosaic.worker.worker import Worker

PROMPTS = [[1, 3504, 314, 260], [1, 504, 2102, 28, 1226, 30, 1330]]


def engine_config(num_blocks: int = 8) -> EngineConfig:
    return EngineConfig(dtype="float32", quantization=None,
                        cache=CacheConfig(block_size=16, num_blocks=num_blocks, num_host_blocks=0),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=128))


class CountingWrapper(AttentionBackend):
    """Hands every call to the backend it wraps and counts the steps it was bound for."""

    def __init__(self, local: AttentionBackend) -> None:
        super().__init__(local.model, local.kv_cache)
        self.local = local
        self.steps = 0

    def write(self, layer, qkv, rotary, meta):
        return self.local.write(layer, qkv, rotary, meta)

    def attend(self, layer, q, meta):
        return self.local.attend(layer, q, meta)

    def bind(self, batch, meta):
        self.steps += 1
        return self.local.bind(batch, meta)


def generate(engine: Engine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = [engine.add_request(None, prompt, params) for prompt in PROMPTS]
    done = {}
    while engine.has_unfinished():
        done.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
    return [done[i] for i in ids]


def test_each_phase_builds_what_the_last_returned(cached_loader) -> None:
    weights = startup.load_weights(engine_config(8), cached_loader)
    assert weights.draft is None and weights.target is not None and weights.num_scratch_blocks == 0
    plan = startup.plan_kv_cache(weights)
    assert plan == startup.KVCachePlan(num_blocks=8, num_host_blocks=0)  # a fixed budget: nothing measured
    local = startup.build_attention(weights, plan)
    assert local.kv_cache.num_blocks == 8 and local.kv_cache.num_host_blocks == 0
    wrapper = CountingWrapper(local)
    worker = Worker(weights, plan, wrapper)
    assert worker.runner.attention is wrapper and worker.attention is wrapper and worker.kv_cache is local.kv_cache
    assert weights.target is None  # the loader's tensors are let go once the worker is built
    wrapped = generate(Engine(worker.config, LocalExecutor(worker=worker)))
    assert wrapper.steps > 0
    assert wrapped == generate(Engine(engine_config(8), LocalExecutor(engine_config(8), cached_loader)))


def test_a_local_executor_takes_a_config_or_a_worker(cached_loader) -> None:
    with pytest.raises(ValueError, match="a config to start a worker from, or a worker"):
        LocalExecutor()
    worker = Worker.start(engine_config(4), cached_loader)
    with pytest.raises(ValueError, match="not both"):
        LocalExecutor(engine_config(4), worker=worker)
    assert LocalExecutor(worker=worker).num_blocks == 4
