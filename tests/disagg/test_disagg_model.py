"""Prefill on one engine, K/V carried in a Prefix, decode on another: the default model's greedy
tokens equal those of one colocated engine (float32 and an int8 KV cache)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmosaic.config import CacheConfig, EngineConfig, SchedulerConfig
from kvmosaic.disagg import wire
from kvmosaic.disagg.verbs import DecodeEngine, PrefillEngine
from kvmosaic.engine.engine import Engine
from kvmosaic.executor.local import LocalExecutor
from kvmosaic.quant import int_quant
from kvmosaic.quant.format import KVFormat
from kvmosaic.sampling_params import SamplingParams

SYSTEM = "You are a careful assistant who answers questions about geography in one short sentence. "
PROMPTS = [
    "The capital of France is",
    SYSTEM + "Question: which river flows through Cairo?",
    SYSTEM + "Question: what is the tallest mountain in Africa?",  # shares SYSTEM's blocks with the one above
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def config(kv_cache_dtype: str) -> EngineConfig:
    # a 32-token budget: the long prompts prefill in chunks on both sides
    return EngineConfig(dtype="float32", quantization=None,
                        cache=CacheConfig(kv_cache_memory="32MiB", kv_cache_dtype=kv_cache_dtype),
                        scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=32))


def tokens_of(outputs) -> dict[str, list[int]]:
    return {o.request_id: o.outputs[0].token_ids for o in outputs if o.finished}


def colocated(cfg: EngineConfig, loader) -> dict[str, list[int]]:
    engine = Engine(cfg, LocalExecutor(cfg, loader))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    done = {}
    while engine.has_unfinished():
        done |= tokens_of(engine.step())
    return done


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_disaggregated_greedy_equals_colocated(cached_loader, kv_cache_dtype):
    cfg = config(kv_cache_dtype)
    prefill = PrefillEngine(cfg, LocalExecutor(cfg, cached_loader))
    decode = DecodeEngine(cfg, LocalExecutor(cfg, cached_loader))
    done = {}
    for i, prompt in enumerate(PROMPTS):
        prefix = prefill.prefill(str(i), prompt, GREEDY)
        if i == 3:  # a transfer that failed: the decode side recomputes the prompt
            prefix = dataclasses.replace(prefix, kv=None)
        decode.insert(prefix)
        done |= tokens_of(decode.generate())  # requests join a running batch
    while decode.has_work():
        done |= tokens_of(decode.generate())
    assert done == colocated(cfg, cached_loader)
    stats = decode.stats()
    assert stats["prefix_cache_hits"] > 0  # the second SYSTEM prompt loaded only its own blocks
    assert stats["kv_blocks_used"] == 0 and prefill.stats()["kv_blocks_used"] == 0


@pytest.mark.slow
def test_int8_transfer_of_a_float_cache_loads_the_dequantized_prompt_kv(cached_loader):
    """The decode pool holds exactly the int8 codec's reconstruction of the prefill side's K/V, sent in
    (4 + 64) / 256 of the float32 bytes; greedy tokens still follow the float32 colocated engine."""
    cfg = config("auto")
    prefill = PrefillEngine(cfg, LocalExecutor(cfg, cached_loader), transfer_dtype="int8")
    exact = PrefillEngine(cfg, LocalExecutor(cfg, cached_loader))
    decode = DecodeEngine(cfg, LocalExecutor(cfg, cached_loader))
    prompt = PROMPTS[3]
    sent = prefill.prefill("q", prompt, GREEDY).kv
    floats = exact.prefill("f", prompt, GREEDY).kv
    assert sent.wire == "int8:3x64:float32" and sent.nbytes * 256 == floats.nbytes * (4 + 64)
    heads, dim = floats.data.shape[-2:]
    fmt = KVFormat("int8", heads, dim)
    expected = int_quant.decode(int_quant.encode(floats.data.reshape(-1, heads, dim), fmt), fmt)
    assert torch.equal(wire.decode(sent).data, expected.reshape(floats.data.shape))
    assert (expected.reshape(floats.data.shape) - floats.data).abs().max() < 0.05 * floats.data.abs().max()

    decode.insert(prefill.prefill("0", prompt, GREEDY))
    done = tokens_of(decode.generate())  # the insert's blocks are written in this step
    table = decode.engine.kv_manager.get_block_table("0")[: floats.data.shape[2]]
    tokens = floats.num_tokens  # the slots after them hold the first generated token by now
    loaded = decode.engine.executor.read_kv_blocks(table).flatten(2, 3)[:, :, :tokens]
    assert torch.equal(loaded, expected.reshape(floats.data.shape).flatten(2, 3)[:, :, :tokens])
    while decode.has_work():
        done |= tokens_of(decode.generate())
    assert done["0"] == colocated(cfg, cached_loader)["3"]
