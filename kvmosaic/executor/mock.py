"""A mock executor whose outputs can be worked out by hand (in the spirit of JetStream's mock engine).

It keeps a paged "KV cache" of plain token ids: each step applies its swaps and copies, writes
every scheduled token into its slot (block_table[p // block_size], p % block_size), then reads each
sampled sequence's context back through its block table, checks it against the sequence's tokens
(``KVMismatch`` when a table, a copy-on-write or a swap went wrong) and samples

    next token = (sum of the context's token ids + seed) % vocab_size

with the sample's seed (0 when unseeded; forked siblings of an n > 1 request get distinct seeds
from the scheduler). Proposed tokens are verified greedily: the context up to each proposal is
read back, and proposals are accepted while they equal what the mock model samples there.
Outputs therefore do not depend on how the work was batched, chunked, preempted, served from the
prefix cache or speculated, and engine tests can assert exact tokens. Prompts are
text of the form "t3 t17 t5" (a word-level tokenizer over ``t0 .. t{V-1}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tokenizers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from kvmosaic.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvmosaic.executor.base import Executor
from kvmosaic.model.tokenizer import Tokenizer
from kvmosaic.outputs import ModelOutput, SampledToken, ScheduledRequest, SchedulerOutput

EMPTY_SLOT = -1


def mock_tokenizer(vocab_size: int) -> Tokenizer:
    backend = tokenizers.Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend)


class KVMismatch(AssertionError):
    """The mock cache read back other tokens than the sequence holds."""


def next_token(context: list[int], seed: int | None, vocab_size: int) -> int:
    """The mock model: what it samples after ``context``."""
    return (sum(context) + (seed or 0)) % vocab_size


@dataclass
class MockExecutor(Executor):
    num_device_blocks: int
    block_size: int
    num_swap_blocks: int = 0
    vocab_size: int = 64
    max_model_len: int = 256
    preemption_mode: str = "recompute"
    num_scheduler_steps: int = 1
    steps: list[SchedulerOutput] = field(default_factory=list)  # every step executed, in order

    def __post_init__(self) -> None:
        self.config = EngineConfig(
            model="mock", dtype="float32",
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_device_blocks,
                              num_host_blocks=self.num_swap_blocks),
            scheduler=SchedulerConfig(max_model_len=self.max_model_len, max_num_batched_tokens=self.max_model_len,
                                      preemption_mode=self.preemption_mode,
                                      num_scheduler_steps=self.num_scheduler_steps))
        self.model_config = ModelConfig("llama", self.vocab_size, 8, 16, 1, 1, 1, max_position_embeddings=4096,
                                        name="mock")
        self.tokenizer = mock_tokenizer(self.vocab_size)
        self.eos_token_ids = ()
        self.device = [[EMPTY_SLOT] * self.block_size for _ in range(self.num_device_blocks)]
        self.host = [[EMPTY_SLOT] * self.block_size for _ in range(self.num_swap_blocks)]

    @property
    def num_blocks(self) -> int:
        return self.num_device_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.num_swap_blocks

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.steps.append(sched)
        for device, host in sched.blocks_to_swap_out:
            self.host[host] = list(self.device[device])
        for host, device in sched.blocks_to_swap_in:
            self.device[device] = list(self.host[host])
        for src, dst in sched.blocks_to_copy:
            self.device[dst] = list(self.device[src])
        for load in sched.kv_loads:
            for block_id, slots in zip(load.block_ids, load.data, strict=True):
                self.device[block_id] = list(slots)
        # Every write of the step lands before any read, as a layer writes its KV before attending.
        for s in sched.scheduled:
            for offset, token in enumerate(s.token_ids):
                p = s.start_pos + offset
                self.device[s.block_table[p // self.block_size]][p % self.block_size] = token
        out = ModelOutput()
        for s in sched.scheduled:
            if not s.sample_ids:
                continue
            length = s.start_pos + s.num_tokens
            context = self.read_context(s.block_table, length)
            if context != (s.prompt_token_ids + s.output_token_ids + s.spec_token_ids)[:length]:
                raise KVMismatch(f"{s.request_id}: the cache holds {context}")
            if s.spec_token_ids:
                emitted = self._verify(context, s.spec_token_ids, s.sample_seeds[0])
                out.accepted[s.request_id] = [SampledToken(t, 0.0) for t in emitted[:-1]]
                out.sampled[s.request_id] = SampledToken(emitted[-1], 0.0)
                continue
            for seq_id, seed in zip(s.sample_ids, s.sample_seeds, strict=True):
                out.sampled[seq_id] = SampledToken(next_token(context, seed, self.vocab_size), 0.0)
            if s.num_steps > 1:
                self._decode_on(s, length, out)
        return out

    def _decode_on(self, s: ScheduledRequest, length: int, out: ModelOutput) -> None:
        """Multi-step decoding: each later pass writes the token just sampled into the next slot and
        samples after it (no early stop: the scheduler drops tokens after one that ends the sequence)."""
        emitted = [out.sampled[s.request_id].token_id]
        for _ in range(1, s.num_steps):
            p = length + len(emitted) - 1
            self.device[s.block_table[p // self.block_size]][p % self.block_size] = emitted[-1]
            context = self.read_context(s.block_table, p + 1)
            if context != s.prompt_token_ids + s.output_token_ids + emitted:
                raise KVMismatch(f"{s.request_id}: the cache holds {context}")
            emitted.append(next_token(context, s.sample_seeds[0], self.vocab_size))
        out.accepted[s.request_id] = [SampledToken(t, 0.0) for t in emitted[:-1]]
        out.sampled[s.request_id] = SampledToken(emitted[-1], 0.0)

    def _verify(self, context: list[int], proposals: list[int], seed: int | None) -> list[int]:
        """The tokens a verification emits: accepted proposals, then the model's own next token."""
        base = len(context) - len(proposals)
        emitted = []
        for i in range(len(proposals) + 1):
            emitted.append(next_token(context[:base + i], seed, self.vocab_size))
            if i == len(proposals) or emitted[-1] != proposals[i]:
                return emitted
        raise AssertionError("unreachable")

    def read_kv_blocks(self, block_ids: list[int]) -> list[list[int]]:
        return [list(self.device[block_id]) for block_id in block_ids]

    def read_context(self, block_table: list[int], length: int) -> list[int]:
        """The tokens in the first ``length`` slots of a block table."""
        return [self.device[block_table[p // self.block_size]][p % self.block_size] for p in range(length)]
