"""What a prefill hands to a decode engine: the prompt, its first sampled token and its K/V."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvmosaic.outputs import SampledToken
from kvmosaic.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class PrefixKV:
    """A prompt's K/V in the pool's own layout: a tensor [layers, 2, blocks, block_size, ...]
    (records of the cache's format when it is quantized), or per block a list of token ids from the
    mock executor. Both sides must use the same cache format; a float cache's K/V may travel as int8
    records (``kvmosaic.disagg.wire``)."""

    data: Any
    num_tokens: int
    block_size: int
    kv_cache_dtype: str
    wire: str = "auto"  # "auto": the cache's own format; "int8:HxD:dtype": a float cache's values as int8 records

    def blocks(self, first: int, last: int) -> Any:
        if isinstance(self.data, torch.Tensor):
            return self.data[:, :, first:last]
        return self.data[first:last]

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, torch.Tensor):
            return self.data.numel() * self.data.element_size()
        return 0


@dataclass(frozen=True, slots=True)
class Prefix:
    request_id: str
    prompt: str | list[int]  # as the user gave it (the decode side detokenizes against it)
    prompt_token_ids: list[int]
    params: SamplingParams
    first: SampledToken  # the token sampled after the prompt, with its logprobs when asked
    kv: PrefixKV | Any | None  # None: the decode side recomputes the prompt; a connector may put a handle here
    arrival_time: float
    prefill_seconds: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens the prefill side found in its prefix cache
