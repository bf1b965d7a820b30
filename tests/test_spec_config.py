"""Speculative-decoding configuration and the adaptive choice of k."""

from __future__ import annotations

import pytest
from spec_proposers import ScriptedProposer

from kvmosaic.config import EngineConfig
from kvmosaic.config_spec import SpeculativeConfig, SpeculativeConfigError
from kvmosaic.core.speculation.ngram import NgramProposer
from kvmosaic.core.speculation.speculator import Speculator, build_speculator
from kvmosaic.entrypoints.cli import build_parser
from kvmosaic.request import Request
from kvmosaic.sampling_params import SamplingParams


def test_parse_dict_json_and_off():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 2, 5)
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 2}').num_speculative_tokens == 2
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse({}) is None
    assert EngineConfig(speculative={"method": "ngram"}).speculative == SpeculativeConfig()
    speculator = build_speculator(config)
    assert isinstance(speculator.proposer, NgramProposer) and speculator.proposer.max_n == 5
    assert build_speculator(None) is None


@pytest.mark.parametrize("value, message", [
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "draft"}, "takes the draft's path"),
    ({"method": "self", "model": "x.gguf"}, "takes the draft's path"),
    ({"method": "self", "quantization": "q3_k"}, "quantization is the draft's weight format"),
    ({"method": "ngram", "quantization": "q4_0"}, "quantization is the draft's weight format"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"token_cost": -1}, "token_cost"),
    ({"adaptive": "yes"}, "adaptive"),
    ({"num_spec_tokens": 3}, "unknown speculative config keys"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be an object"),
])
def test_bad_configs_raise_a_typed_error(value, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        SpeculativeConfig.parse(value)


def test_cli_flag(capsys):
    args = build_parser().parse_args(["generate", "hi", "--speculative-config", '{"num_speculative_tokens": 3}'])
    assert args.speculative == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "nope"}'])
    assert exit_info.value.code == 2 and "method must be one of" in capsys.readouterr().err


def _request(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(temperature=0.0), arrival_time=0.0)


def _k(speculator: Speculator, request_id: str, batch_size: int = 1, limit: int = 8) -> int:
    """How many tokens the speculator asks its proposer for."""
    proposer = speculator.proposer
    proposer.asked.clear()
    speculator.propose([(_request(request_id), limit)], batch_size)
    return proposer.asked[0].max_tokens if proposer.asked else 0


def test_adaptive_k_follows_acceptance_and_backs_off_with_the_batch():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=8, token_cost=0.1), ScriptedProposer([]))
    # unknown acceptance (1/2) at batch 1: the threshold is 0.1 / 1.1, so 0.5 ** 3 > 0.091 > 0.5 ** 4
    assert _k(speculator, "a") == 3
    assert _k(speculator, "a", limit=2) == 2
    # batch 16: threshold 1.6 / 2.6 = 0.62 > 0.5: no speculation
    assert _k(speculator, "a", batch_size=16) == 0
    for _ in range(10):
        speculator.record("good", 8, 8)
    assert _k(speculator, "good") == 8
    assert _k(speculator, "good", batch_size=16) >= 4
    assert speculator.stats.mean_accepted_length == pytest.approx(1 + 80 / 10)
    failing = Speculator(SpeculativeConfig(num_speculative_tokens=8, token_cost=0.1), ScriptedProposer([]))
    for _ in range(10):
        failing.record("bad", 3, 0)
    assert _k(failing, "bad") == 0
    # steps without speculation let old failures fade: the sequence probes again
    assert any(_k(failing, "bad") > 0 for _ in range(20))


def test_a_new_sequence_starts_from_the_recent_acceptance_of_others():
    """The prior of a sequence never verified is the pooled acceptance of recent verifications (one
    count of it in the sequence's own estimate), never below 1/2."""
    config = SpeculativeConfig(num_speculative_tokens=8, token_cost=0.1, draft_cost=0.5, method="self")
    speculator = Speculator(config, ScriptedProposer([]))

    def drafted(request_id: str) -> int:  # k to draft at batch 1: threshold (0.1 + 0.5) / 1.1 = 6 / 11
        return speculator._k(request_id, speculator._threshold(1), False)

    assert drafted("new") == 0  # 1/2 does not beat 6 / 11
    for _ in range(4):
        speculator.record("old", 8, 7)  # 7 accepted, then a rejection; four times
    accepted, rejected = 7 * sum(0.9 ** i for i in range(4)), sum(0.9 ** i for i in range(4))
    pooled = (accepted + 0.5) / (accepted + rejected + 1)
    assert pooled ** 4 > 6 / 11 > pooled ** 5
    assert drafted("new") == 4
    assert speculator._rate("other", False, batch_size=16) == 0.5  # in a batch a sequence earns its k
    speculator.record("new", 4, 0)  # its own rejection weighs against one count of the prior
    pooled = (0.9 * accepted + 0.5) / (0.9 * (accepted + rejected) + 1 + 1)
    assert pooled / 2 < 6 / 11 and drafted("new") == 0
    # a pool of failures leaves the prior at 1/2: a new sequence of an n-gram proposer still probes
    ngram = Speculator(SpeculativeConfig(num_speculative_tokens=8, token_cost=0.1), ScriptedProposer([]))
    for _ in range(10):
        ngram.record("old", 3, 0)
    assert _k(ngram, "new") == 3


def test_fixed_k_when_not_adaptive():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=5, adaptive=False), ScriptedProposer([]))
    speculator.record("a", 5, 0)
    assert _k(speculator, "a", batch_size=64) == 5


def test_a_step_is_speculated_only_when_its_proposals_repay_leaving_the_decode_path():
    config = SpeculativeConfig(num_speculative_tokens=8, token_cost=0.1, step_overhead=0.15)
    # a sequence never verified: always tried, its acceptance is yet to be measured
    speculator = Speculator(config, ScriptedProposer([[5, 6, 7], [5, 6, 7]]))
    assert speculator.propose([(_request("a"), 8)], 1).keys() == {"a"}
    # acceptance 1/2 at batch 1: 3 proposals expect 0.875 tokens, 0.27 of which their compute would buy
    speculator.record("a", 2, 1)
    assert speculator.propose([(_request("a"), 8)], 1).keys() == {"a"}
    # one proposal of a sequence accepted about 1 time in 5: 0.19 - 0.09 is not worth 0.15 / 1.1
    speculator = Speculator(config, ScriptedProposer([[5]]))
    for _ in range(10):
        speculator.record("a", 1, 0)
    speculator.record("a", 1, 1)
    assert _k(speculator, "a") == 1
    speculator.proposer.script = [[5]]
    assert speculator.propose([(_request("a"), 8)], 1) == {}
