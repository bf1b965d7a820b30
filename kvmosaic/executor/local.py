"""One worker in this process."""

from __future__ import annotations

from kvmosaic.config import EngineConfig
from kvmosaic.executor.base import Executor
from kvmosaic.ops import Kernels
from kvmosaic.outputs import ModelOutput, SchedulerOutput
from kvmosaic.worker.startup import ModelLoader
from kvmosaic.worker.worker import Worker


class LocalExecutor(Executor):
    def __init__(self, config: EngineConfig | None = None, loader: ModelLoader | None = None,
                 kernels: Kernels | None = None, *, worker: Worker | None = None) -> None:
        """A worker started from ``config`` (and ``loader``, ``kernels``), or ``worker``, built already."""
        if (worker is None) == (config is None):
            raise ValueError("a LocalExecutor takes a config to start a worker from, or a worker, not both")
        self.worker = worker if worker is not None else Worker.start(config, loader, kernels)
        self.config = self.worker.config
        self.model_config = self.worker.model_config
        self.tokenizer = self.worker.tokenizer
        self.eos_token_ids = self.worker.eos_token_ids

    @property
    def num_blocks(self) -> int:
        return self.worker.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.worker.num_host_blocks

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        return self.worker.execute(sched)

    def read_kv_blocks(self, block_ids: list[int]) -> object:
        return self.worker.kv_cache.read_blocks(block_ids)

    def describe(self) -> str:
        cache, cfg = self.worker.kv_cache, self.config
        return (f"{self.model_config.name or self.model_config.architecture}: {cache.num_blocks} KV blocks of "
                f"{cfg.cache.block_size} tokens ({cache.num_host_blocks} host blocks), KV cache "
                f"{cfg.cache.kv_cache_dtype} ({cache.bits_per_value:.2f} bits/value), "
                f"attention {type(self.worker.attention).__name__}")
