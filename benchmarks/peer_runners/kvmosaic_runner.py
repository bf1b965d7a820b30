"""kvmosaic on one workload: ``python kvmosaic_runner.py --workload A --dtype float32 [--model-path DIR]``.

Without --model-path it runs the embedded default model (what the start-up workload S measures).
"""

from __future__ import annotations

import torch
from common import run

from kvmosaic import LLM, SamplingParams


class KvmosaicEngine:
    def __init__(self, model_path: str | None, dtype: str, threads: int) -> None:
        torch.set_num_threads(threads)
        # No prefix caching: workload A runs the same prompt more than once.
        self.llm = LLM(model=model_path, dtype=dtype, num_threads=threads, enable_prefix_caching=False,
                       kv_cache_memory="2GiB", max_num_seqs=64, max_num_batched_tokens=2048)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in self.llm.generate(prompts, params)]


if __name__ == "__main__":
    run("kvmosaic", KvmosaicEngine)
