"""Draft-model speculation ("self": the target's weights quantized; "draft": a model file) on the
embedded SmolLM2 model in float32: greedy output is the plain engine's token for token, with
preemption (both modes) and prefix hits; a self-draft attends over the target's K/V, a draft file
keeps its own K/V in the target's blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_spec_engine import GREEDY, PASSAGE, PROMPTS

from kvmosaic import LLM, SamplingParams
from kvmosaic.attention.kv_cache import KVCache
from kvmosaic.config import CacheConfig, ModelConfig
from kvmosaic.config_spec import SpeculativeConfig, SpeculativeConfigError
from kvmosaic.core.speculation.drafted import DraftedProposer
from kvmosaic.core.speculation.proposer import Proposal, ProposalRequest
from kvmosaic.model.loader import LoadedModel, load_model
from kvmosaic.sample import verify as verify_module
from kvmosaic.sample.rejection import verify_dense
from kvmosaic.worker.draft_model import check_same_vocab, load_draft

SELF = {"method": "self", "num_speculative_tokens": 4}  # q8_0 of the float32 target


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _llm(cached_loader, speculative, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "64MiB")
    if speculative is not None:  # fixed costs: k must not depend on this host's timings
        speculative = {"token_cost": 0.1, "draft_cost": 0.0, **speculative}
    return LLM(model_loader=cached_loader, dtype="float32", quantization=None, speculative=speculative, **kwargs)


@pytest.fixture(scope="module")
def reference(cached_loader) -> list[list[int]]:
    return _tokens(_llm(cached_loader, None).generate(PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def self_llm(cached_loader) -> LLM:
    return _llm(cached_loader, SELF)


@pytest.fixture(scope="module")
def draft_llm(cached_loader, default_model_path) -> LLM:
    # the target's own file as the draft (its Q4_1 matrices run natively): nearly every proposal holds
    return _llm(cached_loader, {"method": "draft", "model": default_model_path, "num_speculative_tokens": 4,
                                "lookup_first": False})


def test_self_draft_greedy_is_plain_greedy(self_llm, reference):
    assert _tokens(self_llm.generate(PROMPTS, GREEDY)) == reference
    stats = self_llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 10 and stats["spec_mean_accepted_length"] > 1.5
    assert stats["prefix_cache_hits"] > 0 and stats["kv_blocks_used"] == 0


def test_draft_model_file_greedy_is_plain_greedy(draft_llm, reference):
    assert _tokens(draft_llm.generate(PROMPTS, GREEDY)) == reference
    stats = draft_llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0.9 * stats["spec_num_draft_tokens"] > 30
    assert stats["prefix_cache_hits"] > 0 and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=20, block_size=4),
    dict(num_blocks=20, block_size=4, preemption_mode="swap", num_host_blocks=64),
], ids=["recompute", "swap"])
def test_self_draft_with_preemption(cached_loader, reference, kwargs):
    llm = _llm(cached_loader, SELF, kv_cache_memory="auto", **kwargs)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == reference
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["kv_blocks_used"] == 0


def _acceptance_after_prefix_hit(llm: LLM, wipe=None) -> float:
    first, second = f"{PASSAGE} {PASSAGE} In short,", f"{PASSAGE} {PASSAGE} The moral is"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(first, params)
    if wipe is not None:
        wipe(llm.engine.executor.worker.kv_cache)
    before = llm.engine.stats()
    llm.generate(second, params)
    after = llm.engine.stats()
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    proposed = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    return (after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]) / proposed


def test_prefix_hit_blocks_carry_the_drafts_kv(cached_loader, default_model_path):
    """A draft file identical to the target (dequantized to float32) accepts every greedy proposal,
    also after a prefix hit, since the hit blocks hold the draft's K/V as well: wiping the draft's
    pool before the hit makes its proposals fail."""
    llm = _llm(cached_loader, {"method": "draft", "model": default_model_path, "quantization": "none",
                               "num_speculative_tokens": 4, "lookup_first": False})
    assert _acceptance_after_prefix_hit(llm) > 0.95
    llm.engine.reset_prefix_cache()  # the second measure's hit is on blocks it computes itself
    assert _acceptance_after_prefix_hit(llm, lambda cache: cache.draft.device_pool.zero_()) < 0.5


def test_self_draft_attends_over_the_targets_kv(cached_loader):
    """A self-draft has no pool of its own: a block costs what it costs without speculation, scratch
    blocks for guesses sit past the pool's blocks, and an unquantized self-draft (the target itself)
    accepts every greedy proposal, after a prefix hit too: its context is the target's K/V."""
    llm = _llm(cached_loader, {"method": "self", "quantization": "none", "num_speculative_tokens": 4,
                               "lookup_first": False})
    cache, model = llm.engine.executor.worker.kv_cache, llm.engine.model_config
    assert cache.draft is None and cache.bytes_per_block == model.kv_bytes_per_token(torch.float32) * cache.block_size
    assert cache.device_pool.shape[2] > cache.num_blocks == (64 << 20) // cache.bytes_per_block
    assert _acceptance_after_prefix_hit(llm) > 0.95


def test_seeded_sampling_reproduces_whatever_the_batch(self_llm):
    params = SamplingParams(temperature=0.8, seed=21, max_tokens=16, ignore_eos=True)
    before = self_llm.engine.stats()["spec_num_accepted_tokens"]
    alone = self_llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    assert self_llm.engine.stats()["spec_num_accepted_tokens"] > before
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batched = self_llm.generate(PROMPTS, [params if i == 0 else others for i in range(len(PROMPTS))])
    assert batched[0].outputs[0].token_ids == alone


def test_unseeded_sampling_verifies_against_the_drafts_q(self_llm, monkeypatch):
    seen = []

    def spy(target_probs, draft_ids, draft_probs, generator):
        seen.append((draft_ids.shape[1], draft_probs.shape))
        return verify_dense(target_probs, draft_ids, draft_probs, generator)

    monkeypatch.setattr(verify_module, "verify_dense", spy)
    before = self_llm.engine.stats()["spec_num_accepted_tokens"]
    self_llm.generate(PROMPTS[:2], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, ignore_eos=True))
    assert self_llm.engine.stats()["spec_num_accepted_tokens"] > before
    vocab = self_llm.engine.model_config.vocab_size
    assert seen and all(shape == (1, k, vocab) for k, shape in seen)


def test_kv_blocks_hold_the_drafts_bytes(draft_llm):
    worker = draft_llm.engine.executor.worker
    cache, model = worker.kv_cache, worker.model_config
    per_block = 2 * model.kv_bytes_per_token(torch.float32) * cache.block_size  # the draft has the same shape
    assert cache.bytes_per_block == per_block and cache.num_blocks == (64 << 20) // per_block
    assert cache.draft.num_blocks > cache.num_blocks  # scratch blocks past the shared ones


def test_swaps_and_copies_move_the_drafts_kv():
    target = ModelConfig("llama", 32, 8, 16, 2, 2, 1, max_position_embeddings=64)
    draft = ModelConfig("llama", 32, 4, 16, 1, 2, 1, max_position_embeddings=64)
    budget = 6 * (target.kv_bytes_per_token(torch.float32) + draft.kv_bytes_per_token(torch.float32)) * 4
    cache = KVCache(target, CacheConfig(block_size=4, kv_cache_memory=budget, num_host_blocks=2), torch.float32,
                    draft=draft, num_scratch_blocks=3)
    assert (cache.num_blocks, cache.draft.num_blocks, cache.draft.num_host_blocks) == (6, 9, 2)
    cache.draft.device_pool[:, :, 1] = 7.0
    cache.swap_out([(1, 0)])
    cache.copy([(1, 2)])
    cache.draft.device_pool[:, :, 1] = 0.0
    cache.swap_in([(0, 3)])
    assert (cache.draft.device_pool[:, :, 2] == 7).all() and (cache.draft.device_pool[:, :, 3] == 7).all()


def test_drafted_proposer_hands_over_one_steps_proposals():
    proposer = DraftedProposer()
    assert proposer.tokens_to_draft(3) == 3
    q = torch.full((3, 5), 0.2)
    proposer.receive({"a": Proposal([1, 2, 3], q), "b": Proposal([4])})
    got = proposer.propose([ProposalRequest("a", [0], 2), ProposalRequest("c", [0], 2)])
    assert got[0].token_ids == [1, 2] and got[0].draft_probs.shape == (2, 5) and got[1].token_ids == []
    assert proposer.propose([ProposalRequest("a", [0], 2)])[0].token_ids == []  # used once
    proposer.receive({})
    assert proposer.propose([ProposalRequest("b", [0], 2)])[0].token_ids == []  # only the last step's


def test_unknown_draft_path_is_a_typed_error(cached_loader):
    with pytest.raises(SpeculativeConfigError, match="does not exist"):
        _llm(cached_loader, {"method": "draft", "model": "/nonexistent/draft.gguf"})


def test_vocab_mismatch_is_a_typed_error(default_model):
    smaller = dataclasses.replace(default_model.config, vocab_size=default_model.config.vocab_size - 1)
    with pytest.raises(SpeculativeConfigError, match="vocabulary differs"):
        check_same_vocab(default_model, LoadedModel(smaller, {}, default_model.tokenizer))

    class Shifted:
        vocab_size = default_model.tokenizer.vocab_size

        def id_to_token(self, token_id: int) -> str | None:
            return default_model.tokenizer.id_to_token((token_id + 1) % self.vocab_size)

    with pytest.raises(SpeculativeConfigError, match="tokenizer differs"):
        check_same_vocab(default_model, LoadedModel(default_model.config, {}, Shifted()))
    assert SpeculativeConfig(method="self").draft_quantization == "q8_0"


class _RecordingRunner:
    """A draft runner whose logits put all mass on token 7; records every batch it is given."""

    block_size = 4

    def __init__(self) -> None:
        self.batches: list[list[tuple[list[int], int]]] = []
        self.tables: list[list[int]] = []

    def compute_logits(self, pending):
        self.batches.append([(list(r.token_ids), r.start_pos) for r in pending])
        self.tables.extend(list(r.block_table) for r in pending)
        rows = [r for r in pending if r.sample_ids]
        logits = torch.zeros(len(rows), 10)
        logits[:, 7] = 1.0
        return rows, logits


def test_cache_sharing_drafter_runs_only_the_new_token_and_its_guesses():
    """Over the target's K/V: nothing for sequences drafting nothing or not sampling (a prefill
    chunk); a drafting one runs its new token at its position (after the tokens it kept: accepted
    proposals count, rejected ones do not), then its guesses, past its blocks in scratch blocks."""
    from kvmosaic.outputs import ModelOutput, SampledToken, ScheduledRequest
    from kvmosaic.worker.drafter import CacheSharingDrafter

    runner = _RecordingRunner()
    drafter = CacheSharingDrafter(runner, num_blocks=8, num_scratch_blocks=2, max_positions=64)
    greedy = SamplingParams(temperature=0.0)
    chunk = ScheduledRequest("p", [1, 2, 3], 0, [0], greedy, num_draft_tokens=3)  # not sampled
    idle = ScheduledRequest("i", [5], 6, [2, 3], greedy, sample_ids=["i"], sample_seeds=[None])
    verify = ScheduledRequest("v", [4, 5, 6], 5, [4, 5], greedy, sample_ids=["v"], sample_seeds=[None],
                              spec_token_ids=[5, 6], num_draft_tokens=3)
    out = ModelOutput(sampled={"i": SampledToken(9, None), "v": SampledToken(8, None)},
                      accepted={"v": [SampledToken(5, None)]})  # 5 accepted, 6 rejected: 8 sits at 5 + 2
    work = drafter.propose([chunk, idle, verify], out)
    assert runner.batches == [[([8], 7)], [([7], 8)], [([7], 9)]] and runner.tables[0] == [4, 5, 8]
    assert work.proposals["v"].token_ids == [7, 7, 7] and set(work.proposals) == {"v"} and work.passes == 3
    runner.batches.clear()
    assert drafter.propose([idle], out).passes == 0 and runner.batches == []


def test_prompt_lookup_comes_before_drafting():
    """With lookup sizes, a sequence whose last tokens (after this step's new one) occurred earlier
    takes what followed them (up to its lookup k) and is not drafted; one without a match is."""
    from kvmosaic.outputs import ModelOutput, SampledToken, ScheduledRequest
    from kvmosaic.worker.drafter import CacheSharingDrafter

    runner = _RecordingRunner()
    drafter = CacheSharingDrafter(runner, num_blocks=8, num_scratch_blocks=4, max_positions=64, lookup_sizes=(2, 3))
    greedy = SamplingParams(temperature=0.0)

    def decode(seq_id: str, prompt: list[int], outputs: list[int]) -> ScheduledRequest:
        return ScheduledRequest(seq_id, outputs[-1:], len(prompt) + len(outputs) - 1, [0, 1, 2], greedy,
                                sample_ids=[seq_id], sample_seeds=[None], prompt_token_ids=prompt,
                                output_token_ids=outputs, num_draft_tokens=2, num_lookup_tokens=3)

    copying = decode("c", [11, 12, 13, 14, 15, 16], [11])  # + new 12: "11 12" occurred, 13 14 15 followed
    fresh = decode("f", [21, 22, 23], [24])  # + new 25: no repeat
    out = ModelOutput(sampled={"c": SampledToken(12, None), "f": SampledToken(25, None)})
    work = drafter.propose([copying, fresh], out)
    assert work.proposals["c"].token_ids == [13, 14, 15] and work.proposals["c"].draft_probs is None
    assert work.proposals["f"].token_ids == [7, 7] and runner.batches == [[([25], 4)], [([7], 5)]]


def test_decode_tokens_are_mirrored_only_when_the_sequence_drafts():
    # Prefill chunks are mirrored at once; decode tokens drafting nothing (k = 0) wait and go with
    # the next drafting step, as one row from the first unmirrored position.
    from kvmosaic.outputs import ModelOutput, SampledToken, ScheduledRequest
    from kvmosaic.worker.drafter import MirroringDrafter

    runner = _RecordingRunner()
    drafter = MirroringDrafter(runner, num_blocks=8, num_scratch_blocks=2, max_positions=64)
    greedy = SamplingParams(temperature=0.0)

    def step(tokens, start, k, new_token):
        s = ScheduledRequest("a", tokens, start, [0, 1, 2], greedy, sample_ids=["a"], sample_seeds=[None],
                             num_draft_tokens=k)
        return drafter.propose([s], ModelOutput(sampled={"a": SampledToken(new_token, None)})).proposals

    assert step([1, 2, 3], 0, 0, 4) == {}  # the prompt: mirrored, no draft asked
    assert runner.batches == [[([1, 2, 3], 0)]]
    assert step([4], 3, 0, 5) == {} and step([5], 4, 0, 6) == {}  # decodes with k = 0: no model work
    assert len(runner.batches) == 1
    proposals = step([6], 5, 2, 9)  # drafts: tokens 4, 5, 6 and the new 9 from position 3, then a guess
    assert runner.batches[1:] == [[([4, 5, 6, 9], 3)], [([7], 7)]]
    assert proposals["a"].token_ids == [7, 7]
    runner.batches.clear()
    assert step([8], 7, 0, 1) == {} and runner.batches == []  # position 7 waits...
    step([2], 5, 1, 3)  # ...but the sequence went back to position 5 (recomputed): nothing carried over
    assert runner.batches == [[([2, 3], 5)]]


def test_self_draft_of_a_quantized_target_warns(default_model, caplog):
    """A Q4_0 self-draft of the shipped Q4_1 weights streams as many bytes as the target: a warning
    says so; of the float32 target it reads far fewer and says nothing."""
    with caplog.at_level("WARNING", logger="kvmosaic.worker.draft_model"):
        load_draft(SpeculativeConfig(method="self"), default_model, torch.float32)
        assert not caplog.records
        load_draft(SpeculativeConfig(method="self"), load_model(None, torch.float32), torch.float32)
    assert len(caplog.records) == 1 and "expect no speed-up" in caplog.records[0].getMessage()
