"""The distributed KV cache across two Ray nodes on one machine.

A head node and a second node that joins it, each a raylet of its own with its own resources
(``ray.cluster_utils.Cluster`` starts them as ``ray start --head`` and ``ray start --address`` would,
and stops only its own processes). Three instances with tiny pools, pinned: 0 and 2 on the head,
1 on the second node. A prompt routed to instance 0 needs more blocks than it has; its creditors are
asked same node first, so instance 2 lends everything it has before instance 1, across nodes, lends
the rest, although instance 1 comes first by id. The greedy tokens equal one large instance's.
"""

from __future__ import annotations

import pytest
import torch

from kvmosaic.config import CacheConfig, DistributedConfig, EngineConfig, SchedulerConfig
from kvmosaic.engine.engine import Engine
from kvmosaic.executor.local import LocalExecutor
from kvmosaic.sampling_params import SamplingParams

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster as RayNodes  # noqa: E402

from kvmosaic.distributed.cluster import Cluster  # noqa: E402

pytestmark = pytest.mark.slow
BLOCKS = 8  # per instance, 16 tokens each
STORE = 100 * 1024**2  # object store bytes per node


def engine_config(num_blocks: int) -> EngineConfig:
    return EngineConfig(
        dtype="float32", quantization=None, num_threads=1,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, num_host_blocks=0),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=512),
    )


@pytest.fixture(scope="module")
def two_nodes(ray_runtime, restart_local_ray):
    """Node ids of a two-node Ray cluster this process is connected to; the session's local runtime
    is stopped meanwhile and started again afterwards."""
    if ray.is_initialized():
        ray.shutdown()
    nodes = RayNodes(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"head_node": 1}, "object_store_memory": STORE, "include_dashboard": False})
    nodes.add_node(num_cpus=1, resources={"second_node": 1}, object_store_memory=STORE)
    try:
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, log_to_driver=False)
        ids = {}
        for node in ray.nodes():
            for name in ("head_node", "second_node"):
                if node["Alive"] and name in node["Resources"]:
                    ids[name] = node["NodeID"]
        assert set(ids) == {"head_node", "second_node"} and ids["head_node"] != ids["second_node"]
        yield ids
    finally:
        ray.shutdown()
        nodes.shutdown()
        restart_local_ray()


def test_creditors_on_the_same_node_lend_first_and_cross_node_attention_matches(two_nodes, cached_loader):
    head, second = two_nodes["head_node"], two_nodes["second_node"]
    dist = DistributedConfig(num_instances=3, heartbeat_interval=0.2, missed_heartbeats=25, dgfm_interval=0,
                             instance_nodes=(head, second, head))
    cluster = Cluster(engine_config(BLOCKS), dist)
    try:
        assert cluster.ledger()["nodes"] == {0: head, 1: second, 2: head}
        tokens = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(7)).tolist()
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
        request_id = cluster.add_request(None, tokens, params)
        assert cluster.route[request_id] == 0
        finished = None
        for _ in range(2000):
            for out in cluster.step():
                if out.finished:
                    finished = out
            if finished is not None:
                break
        assert finished is not None and finished.outputs[0].finish_reason == "length", finished
        stats = cluster.instance_stats()
        # 308 tokens need 20 blocks: 8 local, then 8 from instance 2 (same node, asked first although
        # instance 1 has as many free blocks and a lower id), then the rest from instance 1
        assert stats[2]["dist_blocks_lent_total"] == BLOCKS
        assert 0 < stats[1]["dist_blocks_lent_total"] < BLOCKS
        assert stats[0]["dist_remote_compute_seconds"] > 0  # creditors computed micro-attention for it
        # both kinds of answer: partials (decode queries) and, for the prefill chunks over a short
        # borrowed tail, the lent K/V rows attended over on instance 0
        assert 0 < stats[0]["dist_kv_pulls"] < stats[0]["dist_remote_calls"]
        # the decode rows' calls went over the creditors' C++ lanes (one of them on the other node), the
        # prefill chunks' over the channel
        assert 0 < stats[0]["dist_lane_calls"] < stats[0]["dist_remote_calls"]
    finally:
        cluster.shutdown()
    reference = Engine(engine_config(64), LocalExecutor(engine_config(64), cached_loader))
    reference.add_request("ref", tokens, params)
    expected = None
    while reference.has_unfinished():
        for out in reference.step():
            if out.finished:
                expected = out.outputs[0].token_ids
    assert finished.outputs[0].token_ids == expected
