"""The executor interface: the engine's only way to run a step. An executor owns one or more
workers (model, KV cache, runner) and describes what it serves; the engine holds no tensors."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvmosaic.config import EngineConfig, ModelConfig
from kvmosaic.model.tokenizer import Tokenizer
from kvmosaic.outputs import ModelOutput, SchedulerOutput


class Executor(ABC):
    config: EngineConfig  # resolved for the model (e.g. max_model_len within what it supports)
    model_config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Device KV blocks every worker holds (block ids 0 .. num_blocks - 1)."""

    @property
    @abstractmethod
    def num_host_blocks(self) -> int:
        """Host swap-tier blocks (0 unless preemption swaps)."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Apply the step's block moves, run its tokens, sample one token per sample id."""

    def read_kv_blocks(self, block_ids: list[int]) -> object:
        """A copy of these device blocks' K/V in the pool's own layout (what a ``KVLoad`` carries):
        how a prefill worker hands a prompt's KV on. Executors that cannot raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot read KV blocks out")

    def describe(self) -> str:
        """One line for the start-up log."""
        return f"{type(self).__name__}: {self.num_blocks} KV blocks, {self.num_host_blocks} host blocks"

    def shutdown(self) -> None:  # noqa: B027  (optional: in-process executors hold nothing to release)
        """Release workers (a no-op for in-process ones)."""
