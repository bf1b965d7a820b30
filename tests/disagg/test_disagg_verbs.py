"""JetStream's verbs (prefill -> Prefix -> insert -> generate) on the paged engine, driven through the
mock executor: next token = (sum of the context's token ids) % 64, and its "KV cache" holds the
token ids themselves, so a wrong load is read back as the wrong context (KVMismatch)."""

from __future__ import annotations

import dataclasses

import pytest

from kvmosaic.disagg.prefix import PrefixKV
from kvmosaic.disagg.verbs import DecodeEngine, PrefillEngine
from kvmosaic.executor.mock import EMPTY_SLOT, MockExecutor
from kvmosaic.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)


def engines(block_size: int = 4, decode_blocks: int = 16) -> tuple[PrefillEngine, DecodeEngine, MockExecutor]:
    decode_executor = MockExecutor(num_device_blocks=decode_blocks, block_size=block_size)
    return (PrefillEngine(executor=MockExecutor(num_device_blocks=16, block_size=block_size)),
            DecodeEngine(executor=decode_executor), decode_executor)


def finish(decode: DecodeEngine) -> dict[str, list[int]]:
    done = {}
    while decode.has_work():
        for out in decode.generate():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_prefill_returns_the_first_token_and_the_prompt_blocks():
    prefill, _, _ = engines()
    prefix = prefill.prefill("a", "t1 t2 t3 t4 t5", GREEDY)
    assert prefix.first.token_id == 15
    assert prefix.kv.num_tokens == 5
    assert prefix.kv.data == [[1, 2, 3, 4], [5, EMPTY_SLOT, EMPTY_SLOT, EMPTY_SLOT]]
    assert not prefill.engine.has_unfinished()
    assert prefill.engine.stats()["kv_blocks_used"] == 0


def test_insert_loads_the_prompt_and_decodes_from_the_first_token():
    prefill, decode, executor = engines()
    decode.insert(prefill.prefill("a", "t1 t2 t3 t4 t5", GREEDY))
    assert finish(decode) == {"a": [15, 30, 60, 56]}  # 15, then the sum doubles mod 64
    first = executor.steps[0]
    (scheduled,) = first.scheduled
    # only the first token runs: the prompt's 5 tokens were loaded into the request's two blocks
    assert (scheduled.token_ids, scheduled.start_pos) == ([15], 5)
    (load,) = first.kv_loads
    assert load.block_ids == tuple(scheduled.block_table[:2])
    assert load.data == [[1, 2, 3, 4], [5, EMPTY_SLOT, EMPTY_SLOT, EMPTY_SLOT]]
    assert decode.stats()["kv_blocks_used"] == 0


def test_insert_loads_only_the_blocks_the_local_prefix_cache_lacks():
    prefill, decode, executor = engines()
    decode.insert(prefill.prefill("warm", "t1 t2 t3 t4 t5 t6 t7 t8 t9", GREEDY))
    finish(decode)
    executor.steps.clear()
    decode.insert(prefill.prefill("b", "t1 t2 t3 t4 t5 t6 t7 t8 t10 t11", GREEDY))
    assert finish(decode) == {"b": [57, 50, 36, 8]}  # prompt sum 57; then 114, 164, 200 (mod 64)
    (load,) = executor.steps[0].kv_loads
    table = executor.steps[0].scheduled[0].block_table
    assert load.block_ids == (table[2],)  # blocks 0 and 1 were prefix-cache hits
    assert load.data == [[10, 11, EMPTY_SLOT, EMPTY_SLOT]]


def test_insert_without_kv_recomputes_the_prompt():
    prefill, decode, executor = engines()
    prefix = prefill.prefill("a", "t1 t2 t3 t4 t5", GREEDY)
    decode.insert(dataclasses.replace(prefix, kv=None))
    assert finish(decode) == {"a": [15, 30, 60, 56]}
    first = executor.steps[0]
    assert first.kv_loads == [] and first.scheduled[0].token_ids == [1, 2, 3, 4, 5, 15]


def test_a_first_token_that_ends_the_request_finishes_it_at_insert():
    prefill, decode, executor = engines()
    decode.insert(prefill.prefill("a", "t1 t2 t3", dataclasses.replace(GREEDY, max_tokens=1)))
    outs = decode.generate()
    assert [(o.request_id, o.finished, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == [
        ("a", True, [6], "length")]
    assert not decode.has_work() and executor.steps[-1].scheduled == []
    assert decode.stats()["kv_blocks_used"] == 0


def test_an_aborted_insert_drops_its_kv_and_blocks():
    prefill, decode, _ = engines()
    decode.insert(prefill.prefill("a", "t1 t2 t3 t4 t5", GREEDY))
    decode.generate()
    decode.abort("a")
    decode.insert(prefill.prefill("b", "t1 t2", GREEDY))
    decode.abort("b")  # before its first step: the arrival is discarded
    outs = [(o.request_id, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in decode.generate()]
    assert outs == [("a", [15, 30], "abort"), ("b", [3], None), ("b", [3], "abort")]
    assert not decode.has_work()
    assert len(decode.engine.arrivals) == 0 and decode.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("change", [{"block_size": 8}, {"kv_cache_dtype": "int8"}, {"num_tokens": 4}])
def test_insert_rejects_kv_of_another_layout(change):
    prefill, decode, _ = engines()
    prefix = prefill.prefill("a", "t1 t2 t3 t4 t5", GREEDY)
    with pytest.raises(ValueError, match="K/V"):
        decode.insert(dataclasses.replace(prefix, kv=dataclasses.replace(prefix.kv, **change)))
    assert not decode.has_work()
    decode.insert(prefix)  # the id was not taken by the refused insert
    assert finish(decode) == {"a": [15, 30, 60, 56]}


def test_prefill_rejects_bad_input_and_several_sequences():
    prefill, _, _ = engines()
    with pytest.raises(ValueError, match="empty"):
        prefill.prefill("a", "", GREEDY)
    with pytest.raises(ValueError, match="n and best_of"):
        prefill.prefill("b", "t1", SamplingParams(n=2, temperature=1.0))
    assert not prefill.engine.has_unfinished()


def test_prefix_kv_slices_blocks():
    kv = PrefixKV([[1], [2], [3]], 3, 1, "auto")
    assert kv.blocks(1, 3) == [[2], [3]]
