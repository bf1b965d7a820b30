"""EngineClient: what LLM, the OpenAI server and the CLI call. ``Engine`` (one process) and the
distributed ``Cluster`` both implement it; ``kvmosaic.engine.factory.build_engine`` picks one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvmosaic.config import EngineConfig, ModelConfig
from kvmosaic.model.tokenizer import Tokenizer
from kvmosaic.outputs import RequestOutput
from kvmosaic.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ServingState:
    """Whether the engine can serve a new request now; ``reason`` says why not."""

    ready: bool
    reason: str = ""


SERVING = ServingState(True)


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig  # resolved for the model
    model_config: ModelConfig
    tokenizer: Tokenizer

    @property
    def max_model_len(self) -> int: ...

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Validate and queue a request; ValueError on bad input (nothing queued then)."""

    def abort(self, request_id: str, emit_output: bool = True) -> None:
        """Stop a request and free its blocks; its final output (reason "abort") comes from the next step()."""

    def step(self) -> list[RequestOutput]:
        """Run one step. Requests that fail in it end with finish_reason "abort" and the error as
        stop_reason; an exception escaping step() means the engine's state can no longer be trusted."""

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict: ...

    def serving_state(self) -> ServingState:
        """Whether a live worker of every role a request needs exists (an in-process engine: always);
        cheap, and safe to call from any thread (the server's /health asks it)."""

    def shutdown(self) -> None: ...
