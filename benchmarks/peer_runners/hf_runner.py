"""HF transformers ``generate`` on one workload, from an HF directory, every prompt of a workload in one batch."""

from __future__ import annotations

import torch
from common import run
from transformers import AutoModelForCausalLM


class HFEngine:
    def __init__(self, model_path: str, dtype: str, threads: int) -> None:
        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        # EOS ignored: no stop token at all (min_new_tokens would instead mask EOS and change greedy picks).
        self.model.generation_config.eos_token_id = None

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        batch = torch.tensor(prompts)  # equal lengths: no padding
        with torch.inference_mode():
            out = self.model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=0)
        return out[:, batch.shape[1]:].tolist()


if __name__ == "__main__":
    run("hf-transformers", HFEngine)
