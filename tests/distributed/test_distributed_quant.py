"""Quantized KV pools lend and borrow: a prompt no instance can hold, on a 2-instance cluster whose
instances step independently, gives the greedy tokens of one large instance with the same int8,
int4 or Oaken cache (the creditor quantizes the rows it is sent into its records and attends over
what it lent with the quantized kernels, decode rows through its C++ lane server)."""

from __future__ import annotations

import dataclasses

import pytest
from test_distributed_cluster import BLOCKS, drive, engine_config, params, prompt
from test_quant_engine import _assert_greedy_matches

from kvmosaic.config import DistributedConfig
from kvmosaic.engine.engine import Engine
from kvmosaic.executor.local import LocalExecutor

ray = pytest.importorskip("ray")
from kvmosaic.distributed.cluster import Cluster  # noqa: E402

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


def quantized(num_blocks: int, kv_cache_dtype: str):
    cfg = engine_config(num_blocks)
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, kv_cache_dtype=kv_cache_dtype))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "oaken"])
def test_a_quantized_pool_lends_and_the_tokens_are_one_large_instances(ray_runtime, cached_loader, kv_cache_dtype):
    tokens = prompt(11, 300)  # 300 + 12 tokens: 20 blocks of 16, an instance has 16
    big = quantized(64, kv_cache_dtype)
    engine = Engine(big, LocalExecutor(big, cached_loader))
    engine.add_request("ref", tokens, dataclasses.replace(params(MAX_TOKENS), logprobs=5))
    reference = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                reference = out.outputs[0]
    cluster = Cluster(quantized(BLOCKS, kv_cache_dtype), DistributedConfig(num_instances=2, dgfm_interval=0))
    try:
        rid = cluster.add_request(None, tokens, params(MAX_TOKENS))
        finished: dict = {}
        drive(cluster, finished)
        stats = cluster.stats()
        assert stats["dist_loans_total"] >= 1 and stats["dist_remote_calls"] > 0  # it did borrow
        assert stats["dist_lane_calls"] > 0  # decode rows went to the creditor's quantized lane server
        got = finished[rid].outputs[0]
        assert got.finish_reason == "length"
        _assert_greedy_matches(kv_cache_dtype, [got.token_ids], [reference.token_ids], [reference.logprobs])
    finally:
        cluster.shutdown()
