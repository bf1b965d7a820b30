"""The distributed KV cache end to end on one shared local Ray runtime (2 instances, tiny pools).

One cluster serves every test in order (starting actors costs seconds): borrowing for a prompt no
instance can hold, a DGFM cycle resolved by swaps, then an instance killed mid-request.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvmosaic.config import CacheConfig, DistributedConfig, EngineConfig, SchedulerConfig
from kvmosaic.engine.engine import Engine
from kvmosaic.executor.local import LocalExecutor
from kvmosaic.metrics import ServerMetrics
from kvmosaic.sampling_params import SamplingParams

ray = pytest.importorskip("ray")
from kvmosaic.distributed.cluster import Cluster  # noqa: E402
from kvmosaic.distributed.ray_runtime import wait_until  # noqa: E402

pytestmark = pytest.mark.slow
BLOCKS = 16  # per instance, 16 tokens each: 256 tokens
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def engine_config(num_blocks: int) -> EngineConfig:
    # the float path: a recomputed request must give the tokens of an uninterrupted run, and quantized
    # linears run decode rows (int8 activations) and prefill rows (dequantized panels) differently
    return EngineConfig(
        dtype="float32", quantization=None, num_threads=1,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, num_host_blocks=0),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=512),
    )


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def cluster(ray_runtime):
    # lock-step: the DGFM test steps one instance at a time to build a debt cycle
    dist = DistributedConfig(num_instances=2, heartbeat_interval=0.2, missed_heartbeats=25, dgfm_interval=0,
                             lockstep=True)
    cl = Cluster(engine_config(BLOCKS), dist)
    yield cl
    cl.shutdown()


@pytest.fixture(scope="module")
def local_engine(cached_loader):
    """An in-process engine of the instances' configuration with a pool of ``num_blocks``."""
    return lambda num_blocks: Engine(engine_config(num_blocks), LocalExecutor(engine_config(num_blocks), cached_loader))


@pytest.fixture(scope="module")
def reference(local_engine):
    """Greedy token ids from one in-process engine with a large pool, one prompt at a time."""
    engine = local_engine(256)
    memo: dict[tuple, list[int]] = {}

    def run(tokens: list[int], max_tokens: int) -> list[int]:
        key = (tuple(tokens), max_tokens)
        if key not in memo:
            engine.add_request("ref", tokens, params(max_tokens))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        memo[key] = out.outputs[0].token_ids
        return memo[key]

    return run


def drive(cluster: Cluster, finished: dict, only: set[int] | None = None, until=None, limit: int = 400) -> None:
    for _ in range(limit):
        if until is not None and until():
            return
        if until is None and not cluster.has_unfinished():
            return
        for out in cluster.step(only):
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError(f"the cluster did not get there: {cluster.ledger()} {cluster.instance_stats()}")


def test_long_prompt_borrows_and_matches_one_large_instance(cluster: Cluster, reference, local_engine) -> None:
    tokens = prompt(1, 300)  # 300 + 20 tokens = 20 blocks > 16 per instance
    with pytest.raises(ValueError):
        local_engine(BLOCKS).add_request(None, tokens, params(20))  # alone, it can never fit
    rid = cluster.add_request(None, tokens, params(20))
    finished: dict = {}
    seen_loans: list[dict] = []

    def loaned() -> bool:
        ledger = cluster.ledger()
        if ledger["total_debt"]:
            seen_loans.append(ledger["loans"])
        return bool(seen_loans) and rid in finished

    drive(cluster, finished, until=loaned)
    drive(cluster, finished)
    assert any(loans for loans in seen_loans), "the ledger never showed the loan"
    debtor = cluster.route.get(rid, None)
    assert debtor is None  # finished
    assert finished[rid].outputs[0].finish_reason == "length"
    assert finished[rid].outputs[0].token_ids == reference(tokens, 20)
    assert wait_until(lambda: cluster.ledger()["total_debt"] == 0, 10)
    stats = cluster.stats()
    assert stats["dist_loans_total"] >= 1 and stats["dist_repayments_total"] >= 1
    assert stats["dist_remote_calls"] > stats["dist_lane_calls"] > 0 and stats["dist_borrowed_blocks"] == 0
    metrics = ServerMetrics()
    metrics.set_engine_stats(stats)
    body = metrics.render()[0].decode()
    assert "kvmosaic_dist_loans_total" in body and "kvmosaic_dist_remote_attention_calls_total" in body


def test_dgfm_resolves_a_debt_cycle_by_swaps(cluster: Cluster, reference) -> None:
    work = {
        "fA": (0, prompt(2, 150), 3),  # fills instance 0 while rA prefills, then leaves
        "rA": (0, prompt(3, 200), 8),  # 13 blocks: about 6 local + 7 borrowed from instance 1
        "rB": (1, prompt(4, 290), 10),  # 19 blocks: about 9 local + 10 borrowed from instance 0
    }
    finished: dict = {}
    for name in ("fA", "rA"):
        instance, tokens, max_tokens = work[name]
        cluster.add_request(name, tokens, params(max_tokens), instance=instance)
    drive(cluster, finished, only={0}, until=lambda: "fA" in finished and "rA" in cluster.last_output)
    cluster.add_request("rB", work["rB"][1], params(work["rB"][2]), instance=1)
    drive(cluster, finished, only={1}, until=lambda: "rB" in cluster.last_output)  # rB's prefill is done
    loans = cluster.ledger()["loans"]
    assert loans.get("0->1", 0) > 0 and loans.get("1->0", 0) > 0, loans
    before = cluster.stats()["dist_remote_fraction"]
    assert cluster.resolve_cycles() == 1
    ledger = cluster.ledger()
    k = min(loans["0->1"], loans["1->0"])
    print("DGFM cycle", loans, "remote fraction before", before)
    assert ledger["counters"]["swaps"] >= 1
    assert ledger["loans"].get("0->1", 0) == loans["0->1"] - k
    assert ledger["loans"].get("1->0", 0) == loans["1->0"] - k
    cluster._stats_cache = None
    after = cluster.stats()["dist_remote_fraction"]
    assert after < before
    print("remote fraction after", after)
    drive(cluster, finished)
    for name, (_, tokens, max_tokens) in work.items():
        assert finished[name].outputs[0].token_ids == reference(tokens, max_tokens), name
    assert wait_until(lambda: cluster.ledger()["total_debt"] == 0, 10)


def test_server_over_the_cluster(cluster: Cluster, reference) -> None:
    httpx = pytest.importorskip("httpx")
    from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig

    tokens = prompt(9, 280)  # 280 + 12 tokens: more than one instance holds, so it borrows
    with BackgroundServer(cluster, ServerConfig(port=0, shutdown_grace=1.0)) as srv:
        body = {"prompt": tokens, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()
        time.sleep(0.3)  # the engine loop publishes stats after the step
        metrics = httpx.get(f"{srv.url}/metrics").text
    expected = cluster.tokenizer.decode(reference(tokens, 12))
    assert answer["choices"][0]["text"] == expected
    assert "kvmosaic_dist_loans_total" in metrics and "kvmosaic_dist_instances_alive 2.0" in metrics


def test_killed_instance_is_noticed_and_nothing_hangs(cluster: Cluster, reference) -> None:
    finished: dict = {}
    filler, long_prompt, victim = prompt(5, 100), prompt(6, 200), prompt(7, 150)
    cluster.add_request("f", filler, params(3), instance=0)
    cluster.add_request("r", long_prompt, params(30), instance=0)  # borrows from instance 1
    cluster.add_request("v", victim, params(40), instance=1)
    drive(cluster, finished, until=lambda: cluster.ledger()["loans"].get("0->1", 0) > 0 and "f" in finished)
    cluster.kill_instance(1)
    start = time.monotonic()
    drive(cluster, finished)  # must end: no hang
    assert time.monotonic() - start < 120
    assert finished["v"].outputs[0].finish_reason == "abort"
    assert "instance 1 failed" in finished["v"].outputs[0].stop_reason
    # r lost its borrowed blocks and ran again on instance 0 alone (it fits there): same tokens
    assert finished["r"].outputs[0].token_ids == reference(long_prompt, 30)
    assert wait_until(lambda: not cluster.ledger()["alive"][1], 30)  # the gManager noticed
    assert cluster.ledger()["total_debt"] == 0
    rid = cluster.add_request(None, prompt(8, 40), params(5))  # the survivor keeps serving
    drive(cluster, finished)
    assert finished[rid].outputs[0].token_ids == reference(prompt(8, 40), 5)


def test_llm_with_instances_routes_to_the_least_loaded(ray_runtime, reference) -> None:
    """The default cluster: each instance steps in its own loop, and a prompt no instance can hold
    borrows while the others keep stepping."""
    from kvmosaic import LLM

    llm = LLM(dtype="float32", quantization=None, num_blocks=BLOCKS, block_size=16, max_num_batched_tokens=64,
              max_model_len=512, num_host_blocks=0, instances=2)
    try:
        prompts = [prompt(30, 290)] + [prompt(20 + i, 30 + 10 * i) for i in range(4)]  # 290 + 6: 19 blocks
        outs = llm.generate(prompts, params(6))
        assert [o.outputs[0].token_ids for o in outs] == [reference(p, 6) for p in prompts]
        served = llm.engine.stats()
        assert served["dist_instances_alive"] == 2 and served["kv_blocks_used"] == 0
        assert served["dist_loans_total"] >= 1 and served["dist_remote_calls"] > 0
        per_instance = llm.engine.instance_stats()
        assert all(stats["prefix_cache_queries"] > 0 for stats in per_instance.values())  # both got work
    finally:
        llm.shutdown()
