"""kvmosaic on one workload: ``python kvmosaic_runner.py --workload A --dtype float32 [--model-path DIR]``.

Without --model-path it runs the embedded default model (the default model's start-up workload S).
A weight format (q8_0, q4_1, q4_k_m) with a GGUF file keeps the file's quantized matrices
(quantization="auto"); q8_0 with an HF directory quantizes the float model at load; all with float32
activations. A float dtype with a GGUF file (bf16, f32) dequantizes it to that dtype.
KVMOSAIC_SCHEDULER_STEPS in the environment (set by peers.py --scheduler-steps) is the engine's
num_scheduler_steps, KVMOSAIC_KV_CACHE_DTYPE (peers.py --kv-cache-dtype) its kv_cache_dtype. The KV
pool is made resident at start (kv_cache_prefault) except for start-up (S).
"""

from __future__ import annotations

import os

import torch
from common import WEIGHT_FORMATS, parse_args, run

from kvmosaic import LLM, SamplingParams

KV_POOL_BYTES = 2 << 30


class KvmosaicEngine:
    def __init__(self, model_path: str | None, dtype: str, threads: int) -> None:
        torch.set_num_threads(threads)
        weights = {"quantization": None}  # float rows: every weight in the float dtype
        if dtype in WEIGHT_FORMATS:  # a GGUF weight format, float32 activations
            gguf = model_path is None or model_path.endswith(".gguf")  # None: the embedded Q4_1 file
            weights = {"quantization": "auto" if gguf else dtype}
            dtype = "float32"
        # No prefix caching: workload A runs the same prompt more than once. The 2 GiB pool is made
        # resident at start, as vLLM and llama.cpp reserve their KV caches before the timed runs; not
        # for start-up (S), which measures the default engine (pages written as blocks are used).
        prefault = parse_args().workload != "S"
        self.llm = LLM(model=model_path, dtype=dtype, num_threads=threads, enable_prefix_caching=False,
                       kv_cache_memory=KV_POOL_BYTES, kv_cache_prefault=prefault, max_num_seqs=64,
                       max_num_batched_tokens=2048,
                       num_scheduler_steps=int(os.environ.get("KVMOSAIC_SCHEDULER_STEPS", "1")),
                       kv_cache_dtype=os.environ.get("KVMOSAIC_KV_CACHE_DTYPE", "auto"), **weights)

    def kv_pool_bytes(self) -> int:
        return KV_POOL_BYTES

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in self.llm.generate(prompts, params)]


if __name__ == "__main__":
    run("kvmosaic", KvmosaicEngine)
