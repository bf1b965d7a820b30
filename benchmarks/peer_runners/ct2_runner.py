"""CTranslate2 on one workload, from a converted CTranslate2 model directory (stored in float32).

The compute type (float32 / bfloat16) is chosen at load; prompts go in as the model's token strings.
"""

from __future__ import annotations

import json
from pathlib import Path

import ctranslate2
from common import Unsupported, run


class CT2Engine:
    def __init__(self, model_path: str, dtype: str, threads: int) -> None:
        supported = ctranslate2.get_supported_compute_types("cpu")
        if dtype not in supported:  # ct2 would silently fall back to another compute type
            raise Unsupported(f"this CPU build computes only in {', '.join(sorted(supported))}")
        self.generator = ctranslate2.Generator(model_path, device="cpu", compute_type=dtype,
                                               intra_threads=threads, inter_threads=1)
        self.vocab = json.loads((Path(model_path) / "vocabulary.json").read_text(encoding="utf-8"))

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        tokens = [[self.vocab[i] for i in p] for p in prompts]
        results = self.generator.generate_batch(
            tokens, max_length=max_tokens, sampling_topk=1, beam_size=1, include_prompt_in_result=False,
            end_token=[], max_batch_size=0)
        return [r.sequences_ids[0] for r in results]


if __name__ == "__main__":
    run("ctranslate2", CT2Engine)
