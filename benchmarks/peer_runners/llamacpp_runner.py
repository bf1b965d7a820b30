"""llama.cpp (llama-cpp-python) on one workload, from a GGUF file (f32, bf16, Q8_0 or Q4_1 per --dtype).

llama-cpp-python's Llama holds one sequence, so the prompts of a workload run one after another.
"""

from __future__ import annotations

from itertools import islice

from common import WORKLOADS, context_window, parse_args, run
from llama_cpp import Llama


class LlamaCppEngine:
    def __init__(self, model_path: str, dtype: str, threads: int) -> None:
        n_ctx = context_window(WORKLOADS[parse_args().workload])
        self.n_ctx = n_ctx
        self.llm = Llama(model_path=model_path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def kv_pool_bytes(self) -> int | None:
        """The KV cache llama.cpp reserves: n_ctx tokens of f16 K and V (its default cache type) per layer."""
        meta = self.llm.metadata
        arch = meta.get("general.architecture", "")
        try:
            layers = int(meta[f"{arch}.block_count"])
            heads = int(meta[f"{arch}.attention.head_count"])
            kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
            head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads))
        except (KeyError, ValueError):
            return None
        return self.n_ctx * layers * 2 * kv_heads * head_dim * 2

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = []
        for prompt in prompts:
            self.llm.reset()  # no reuse of a previous prompt's KV: workload A repeats its prompt
            # generate() never stops on EOS by itself; greedy via temp=0.
            tokens = self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
            outs.append(list(islice(tokens, max_tokens)))
        return outs


if __name__ == "__main__":
    run("llama.cpp", LlamaCppEngine)
