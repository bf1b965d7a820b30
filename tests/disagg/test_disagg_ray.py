"""Prefill and decode workers as Ray actors, the K/V through Ray's object store: greedy tokens equal
the colocated engine's, a transfer whose owner died is recomputed, and lost workers fail requests
clearly while the engine goes on."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from test_disagg_model import GREEDY, PROMPTS, colocated, config
from test_disagg_orchestrator import drain

from kvmosaic.config import DisaggConfig, RestartPolicy

ray = pytest.importorskip("ray")
from kvmosaic.disagg.ray_workers import DecodeActor, PrefillActor, build_disaggregated  # noqa: E402

DEADLINE = 120.0


@pytest.mark.slow
def test_ray_workers_equal_colocated_and_survive_lost_workers(ray_runtime, cached_loader):
    cfg = config("auto")
    engine = build_disaggregated(cfg, DisaggConfig(prefill_workers=1, decode_workers=1,
                                                   restart=RestartPolicy(max_restarts=0)))  # lost stays lost
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, GREEDY)
        done = drain(engine, DEADLINE)
        assert {rid: tokens for rid, (tokens, _, _) in done.items()} == colocated(cfg, cached_loader)
        stats = engine.stats()
        assert stats["disagg_kv_bytes_received"] > 0 and stats["disagg_failed_transfers"] == 0
        assert stats["prefix_cache_hits"] > 0 and stats["kv_blocks_used"] == 0

        engine.prefill_workers[0].kill()
        try:  # the idle prefill thread may notice the loss (through its stats call) before this request
            engine.add_request("lost-prefill", PROMPTS[0], GREEDY)
        except RuntimeError as exc:
            assert "every prefill worker is lost" in str(exc)
        else:
            done = drain(engine, DEADLINE)
            assert done["lost-prefill"][1] == "abort" and "prefill worker" in done["lost-prefill"][2]
        with pytest.raises(RuntimeError, match="every prefill worker is lost"):
            engine.add_request("refused", PROMPTS[0], GREEDY)
        assert engine.stats()["disagg_prefill_workers_alive"] == 0
    finally:
        engine.shutdown()


@ray.remote(num_cpus=0)
def _never_in_time(seconds: float) -> bytes:
    time.sleep(seconds)
    return b""


@pytest.mark.slow
def test_a_transfer_that_times_out_is_recomputed(ray_runtime, cached_loader):
    cfg = config("auto")
    prefill = ray.remote(PrefillActor).options(num_cpus=0).remote(cfg)
    decode = ray.remote(DecodeActor).options(num_cpus=0).remote(cfg, 1.0)
    try:
        prefix = ray.get(prefill.prefill.remote("1", PROMPTS[1], GREEDY, time.monotonic()), timeout=DEADLINE)
        late = dataclasses.replace(prefix, kv=dataclasses.replace(prefix.kv, ref=_never_in_time.remote(30.0)))
        ray.get(decode.insert.remote(late), timeout=DEADLINE)
        tokens = []
        for _ in range(GREEDY.max_tokens + 2):
            for out in ray.get(decode.generate.remote(), timeout=DEADLINE):
                tokens = out.outputs[0].token_ids
        assert tokens == colocated(cfg, cached_loader)["1"]
        stats = ray.get(decode.stats.remote())
        assert stats["disagg_failed_transfers"] == 1 and stats["disagg_kv_bytes_received"] == 0
        assert stats["disagg_transfer_seconds"] >= 1.0
    finally:
        ray.kill(prefill, no_restart=True)
        ray.kill(decode, no_restart=True)


def test_the_object_store_round_trip_keeps_bytes_layout_and_wire(ray_runtime):
    from kvmosaic.disagg import wire
    from kvmosaic.disagg.prefix import PrefixKV
    from kvmosaic.disagg.ray_workers import get_kv, put_kv

    data = torch.randn(2, 2, 3, 4, 3, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for kv in (PrefixKV(data, 10, 4, "auto"), wire.encode(PrefixKV(data, 10, 4, "auto"), "int8")):
        back = get_kv(put_kv(kv), timeout=DEADLINE)
        assert torch.equal(back.data, kv.data) and back.data.dtype == kv.data.dtype
        assert (back.num_tokens, back.block_size, back.kv_cache_dtype, back.wire) == (10, 4, "auto", kv.wire)
    assert back.wire == "int8:3x8:bfloat16"
    restored = wire.decode(back).data  # bf16 again, so that a bf16 pool takes it
    assert restored.dtype == torch.bfloat16 and (restored.float() - data.float()).abs().max() < 0.05
