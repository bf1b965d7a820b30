"""Structured output below the server: the constraint type, the compiler and its cache, the packed
token masks in the sampler, logit bias, and jump-forward / completion in the scheduler (with a
scripted guide and the mock executor, whose tokens can be worked out by hand)."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from kvmosaic.core.guide import UNGUIDED
from kvmosaic.engine.engine import Engine
from kvmosaic.executor.mock import MockExecutor
from kvmosaic.sample.sampler import SamplingRow, penalize_and_ban, sample, unpack_token_masks
from kvmosaic.sampling_params import SamplingParams
from kvmosaic.structured import GuidedDecoding
from kvmosaic.structured.grammar_guide import GuideFactory, closed_objects


def test_guided_decoding_takes_exactly_one_constraint():
    assert GuidedDecoding(choice=["a", "b"]).choice == ("a", "b")
    assert GuidedDecoding(json='{"type": "object"}').key == GuidedDecoding(json={"type": "object"}).key
    for bad in [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": "ab"}, {"regex": " "}]:
        with pytest.raises(ValueError):
            GuidedDecoding(**bad)


def test_objects_that_list_properties_are_closed():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "additionalProperties": True,
                                                     "properties": {}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is left alone


def test_compiled_grammars_are_cached_and_guides_follow_outputs(default_model):
    tokenizer = default_model.tokenizer
    factory = GuideFactory(tokenizer, default_model.config.vocab_size)
    spec = GuidedDecoding(regex=r"ab[0-9]{2}")
    assert factory.compile(spec) is factory.compile(GuidedDecoding(regex=r"ab[0-9]{2}"))
    assert factory.start(None) is UNGUIDED
    guide = factory.start(spec)
    forced = guide.forced([])
    assert tokenizer.decode(forced) == "ab"  # the literal prefix is forced
    digits = tokenizer.encode("42", add_special_tokens=False)
    assert guide.num_valid(forced, [*digits, *tokenizer.encode("x", add_special_tokens=False)]) == len(digits)
    (mask,) = guide.masks(forced, [])
    allowed = unpack_token_masks([mask], default_model.config.vocab_size)[0]
    assert allowed[tokenizer.encode("4", add_special_tokens=False)[0]]
    assert not allowed[tokenizer.encode("x", add_special_tokens=False)[0]]
    assert not guide.complete(forced) and guide.complete([*forced, *digits])
    assert guide.fork().forced([]) == forced  # a sibling starts over


def test_masks_bias_and_bans_in_the_sampler():
    mask = struct.pack("<2i", (1 << 0) | (1 << 5), 1 << 1)  # tokens 0, 5 and 33 allowed
    allowed = unpack_token_masks([mask], 40)[0]
    assert allowed.nonzero().flatten().tolist() == [0, 5, 33]
    assert not unpack_token_masks([mask], 70)[0, 64:].any()  # past the mask's end: disallowed
    logits = torch.zeros(2, 40)
    logits[:, 7] = 10.0
    params = SamplingParams(temperature=0.0, logit_bias={33: 3.0, 0: -1.0})
    rows = [SamplingRow(params, None, [], [], allowed_token_mask=mask), SamplingRow(params, None, [], [])]
    processed = penalize_and_ban(logits, rows)
    assert processed[0, 33] == 3.0 and processed[0, 0] == -1.0 and processed[0, 5] == 0.0
    assert math.isinf(processed[0, 7]) and processed[1, 7] == 10.0 and processed[1, 33] == 3.0
    assert [t.token_id for t in sample(logits, rows)] == [33, 7]


class _ScriptedGuide:
    """Forces tokens 30, 31 after the first output; complete after four outputs."""

    def masks(self, outputs, proposals):
        return [None] * (len(proposals) + 1)

    def num_valid(self, outputs, proposals):
        return len(proposals)

    def forced(self, outputs):
        return [30, 31] if len(outputs) == 1 else []

    def complete(self, outputs):
        return len(outputs) >= 4

    def fork(self):
        return self


class _ScriptedGuides:
    def start(self, guided, jump_forward=True):
        return _ScriptedGuide() if guided is not None else UNGUIDED


def test_forced_tokens_run_in_one_pass_and_a_complete_grammar_stops():
    engine = Engine(executor=MockExecutor(num_device_blocks=8, block_size=4), guides=_ScriptedGuides())
    params = SamplingParams(temperature=0.0, max_tokens=10, guided_decoding=GuidedDecoding(regex="x"))
    engine.add_request("r", "t1 t2 t3", params)
    scheduled, outputs = [], []
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        scheduled.append([s.token_ids for s in sched.scheduled])
        model_out = engine.executor.execute(sched)
        updated = engine.scheduler.update_from_output(sched, model_out)
        outputs += engine.processor.process(updated, model_out)[0]
    # prompt -> 6 (sum 6); 30, 31 forced; 6, 30, 31 computed together -> (6 + 6 + 30 + 31) % 64 = 9
    assert scheduled == [[[1, 2, 3]], [[6, 30, 31]]]
    final = outputs[-1].outputs[0]
    assert final.token_ids == [6, 30, 31, 9] and final.finish_reason == "stop"
