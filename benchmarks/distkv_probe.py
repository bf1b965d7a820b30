"""benchmarks/distkv.py's probe of the decode lane: one decode row's remote attention, transfer
included, against the same attention computed locally."""

from __future__ import annotations

import time

import ray
import torch

from kvmosaic.distributed.cluster import Cluster

LANE_KEYS_BLOCKS = 16  # a decode row's remote part in the lane-vs-local probe: 16 lent blocks (256 keys)


def lane_vs_local(cluster: Cluster, config, spin_us: int, shared_memory: bool = True) -> dict | None:
    """One decode row's attention over 16 blocks of another instance's pool through its decode lane
    (transfer included), against the same attention (kernel partial, same shapes, one thread) here.
    Both ends of the lane poll ``spin_us`` microseconds before they sleep. On one machine the lane
    runs through shared rings (``transport``); the same call over the server's Unix socket alone is
    timed beside it (``socket_round_trip_ms``)."""
    from kvmosaic.distributed.decode_lane import DecodeLaneClient
    from kvmosaic.ops import Kernels

    info = ray.get(cluster.instances[1].info.remote())
    lane, kernels = info["decode_lane"], Kernels.load()
    if lane is None or kernels.ops is None or config.cache.num_blocks < LANE_KEYS_BLOCKS:
        return None
    bs, keys = config.cache.block_size, LANE_KEYS_BLOCKS * config.cache.block_size
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, lane.num_heads, lane.head_dim, generator=gen).to(lane.dtype)
    blocks = list(range(LANE_KEYS_BLOCKS))
    item = {"q": q, "q_pos": torch.tensor([keys]), "blocks": blocks, "k_pos": torch.arange(keys), "visible": keys,
            "slots": [], "dtype": lane.dtype, "k_new": None, "v_new": None}
    caches = torch.randn(2, config.cache.num_blocks, bs, lane.num_kv_heads, lane.head_dim, generator=gen).to(lane.dtype)
    table, context = torch.tensor([blocks]), torch.tensor([keys])

    def local() -> None:
        kernels.ops.paged_decode_attention_partial(q, caches[0], caches[1], table, context, lane.head_dim**-0.5)

    secret = cluster.dist_config.cluster_secret
    client = DecodeLaneClient(lane, 30.0, kernels.ops, spin_us, shared_memory, secret=secret)
    socket_client = DecodeLaneClient(lane, 30.0, kernels.ops, spin_us, shared_memory=False, secret=secret)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timings = {"lane": [], "socket": [], "local": []}
        for _ in range(5):  # interleaved rounds, best of each
            for name, fn in (("lane", lambda: client.call("attention", 0, [item], lane.head_dim**-0.5)),
                             ("socket", lambda: socket_client.call("attention", 0, [item], lane.head_dim**-0.5)),
                             ("local", local)):
                fn()
                started = time.perf_counter()
                for _ in range(100):
                    fn()
                timings[name].append((time.perf_counter() - started) / 100)
        transport, socket_transport = client.transport, socket_client.transport
    finally:
        torch.set_num_threads(threads)
        client.close()
        socket_client.close()
    lane_ms, socket_ms, local_ms = (1000 * min(timings[k]) for k in ("lane", "socket", "local"))
    return {"keys": keys, "lane_round_trip_ms": round(lane_ms, 4), "local_kernel_ms": round(local_ms, 4),
            "ratio": round(lane_ms / local_ms, 2), "spin_us": spin_us, "transport": transport,
            "socket_round_trip_ms": round(socket_ms, 4), "socket_ratio": round(socket_ms / local_ms, 2),
            "socket_transport": socket_transport}
