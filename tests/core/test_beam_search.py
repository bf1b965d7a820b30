"""Beam search: the search on hand-made logprobs, and on real models against transformers'
``generate(num_beams=..., length_penalty=..., early_stopping=...)`` (same sequences, same scores in
float32); beams share their blocks copy-on-write; an aborted search frees every beam."""

from __future__ import annotations

import math

import pytest
import torch
from test_model_hf import _write_random_checkpoint

from kvmosaic import LLM, SamplingParams
from kvmosaic.core.beam_search import BeamConfig, BeamGroup

EOS = 2


def test_beam_group_by_hand():
    group = BeamGroup(BeamConfig(width=2, length_penalty=1.0, early_stopping=True, eos_token_ids=frozenset({EOS}),
                                 max_tokens=5), "a")
    lp = math.log
    first = group.step({"a": {10: lp(0.5), 11: lp(0.3), EOS: lp(0.1), 12: lp(0.05)}}, {"a": []})
    assert [(b.parent, b.token_id) for b in first] == [("a", 10), ("a", 11)]
    assert group.finished == []  # EOS ranked third: outside the best two
    group.rename(["a", "b"])
    # a (log .5) -> EOS .9 ends at log .45, the best; b (log .3) -> 13 .9 (.27) and 14 .1 (.03) continue,
    # a -> 15 (.025) does not.
    second = group.step({"a": {EOS: lp(0.9), 15: lp(0.05), 16: lp(0.01), 17: lp(0.01)},
                         "b": {13: lp(0.9), 14: lp(0.1), 18: lp(1e-3), 19: lp(1e-3)}}, {"a": [10], "b": [11]})
    assert [(b.parent, b.token_id) for b in second] == [("b", 13), ("b", 14)]
    assert [(h.token_ids, round(h.score, 5)) for h in group.finished] == [((10, EOS), round(lp(0.45) / 2, 5))]
    assert not group.done
    group.rename(["b", "c"])
    group.step({"b": {EOS: lp(0.9), 20: lp(0.1), 21: lp(1e-3), 22: lp(1e-3)},
                "c": {EOS: lp(0.5), 23: lp(0.5), 24: lp(1e-3), 25: lp(1e-3)}}, {"b": [11, 13], "c": [11, 14]})
    assert group.done  # two finished with early_stopping=True
    assert [h.token_ids for h in group.results(2)] == [(10, EOS), (11, 13, EOS)]
    assert group.results(2)[1].score == pytest.approx(lp(0.3 * 0.9 * 0.9) / 3, abs=1e-6)


def _hf_beams(model, ids, width, length_penalty, early_stopping, max_tokens, eos):
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens,
                         length_penalty=length_penalty, early_stopping=early_stopping, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=eos, eos_token_id=eos)
    out = []
    for sequence, score in zip(ref.sequences, ref.sequences_scores):
        tokens = sequence[len(ids):].tolist()
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        out.append((tokens, score.item()))
    return out


def _assert_same_beams(llm, hf, prompt_ids, width, length_penalty, early_stopping, max_tokens):
    params = SamplingParams(use_beam_search=True, best_of=width, n=width, max_tokens=max_tokens,
                            length_penalty=length_penalty, early_stopping=early_stopping)
    ours = llm.generate([prompt_ids], params, use_tqdm=False)[0].outputs
    reference = _hf_beams(hf, prompt_ids, width, length_penalty, early_stopping, max_tokens, EOS)
    assert [c.token_ids for c in ours] == [tokens for tokens, _ in reference]
    torch.testing.assert_close(torch.tensor([c.score for c in ours]), torch.tensor([s for _, s in reference]),
                               atol=1e-4, rtol=0)
    return ours


@pytest.fixture(scope="module")
def llm(cached_loader) -> LLM:
    return LLM(dtype="float32", kv_cache_memory="128MiB", model_loader=cached_loader)


PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "<|im_start|>user\nWhat is 2+2? Answer with a number only.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (0.5, True)])
def test_default_model_matches_transformers(llm, hf_gguf_model, prompt, width, length_penalty, early_stopping):
    ids = llm.engine.tokenizer.encode(prompt)
    ours = _assert_same_beams(llm, hf_gguf_model, ids, width, length_penalty, early_stopping, max_tokens=12)
    if prompt.endswith("assistant\n"):
        assert any(c.finish_reason == "stop" and c.token_ids[-1] == EOS for c in ours)  # EOS ended hypotheses


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (2.0, "never"), (0.0, True)])
def test_random_checkpoint_matches_transformers(tmp_path, default_model, length_penalty, early_stopping):
    hf = _write_random_checkpoint(tmp_path, "llama", default_model.tokenizer.to_json())
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB")
    ids = [int(t) for t in torch.randint(3, 49152, (11,), generator=torch.Generator().manual_seed(2))]
    for width in (2, 4):
        _assert_same_beams(llm, hf, ids, width, length_penalty, early_stopping, max_tokens=8)


def test_beams_share_blocks_and_an_abort_frees_them(llm):
    engine = llm.engine
    kv = engine.kv_manager
    prompt = list(range(100, 100 + 5 * kv.block_size + 3))  # five full blocks and a partial one
    free_before = kv.num_free_blocks
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=20, ignore_eos=True)
    engine.add_request("beams", prompt, params)
    for _ in range(3):
        engine.step()
    beams = [r for r in engine.scheduler.running if r.group_id == "beams"]
    assert len(beams) == 4
    # The prompt's blocks are shared: each beam adds at most its own copy of the last block and one more.
    assert free_before - kv.num_free_blocks <= 6 + 4 * 2
    tables = [kv.get_block_table(b.request_id) for b in beams]
    assert all(t[:5] == tables[0][:5] for t in tables)
    engine.abort("beams")
    outputs = engine.step()
    assert [o.outputs[0].finish_reason for o in outputs if o.request_id == "beams"] == ["abort"]
    assert not engine.scheduler.running and kv.num_free_blocks == free_before


def test_beam_search_refuses_what_it_cannot_combine_with():
    for bad in [dict(logprobs=1), dict(stop=["x"]), dict(presence_penalty=0.5), dict(early_stopping="sometimes"),
                dict(max_tokens=0)]:
        with pytest.raises(ValueError):
            SamplingParams(use_beam_search=True, best_of=2, **bad)
