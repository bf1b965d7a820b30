"""KV that arrives from elsewhere (a prefill worker) for requests this engine continues.

The scheduler side of a KV connector, as vLLM's connectors have one: when a request is admitted,
its prompt's K/V past the local prefix-cache hits need not be computed if they arrived with it.
The scheduler asks how many tokens arrived, allocates slots for them like for any others, and
hands the step a ``KVLoad`` that the worker stores before the forward pass. An arrival is used
once: a sequence preempted later recomputes from its tokens, as any other."""

from __future__ import annotations

from typing import Protocol

from kvmosaic.outputs import KVLoad
from kvmosaic.request import Request


class ArrivedKV(Protocol):
    """A prompt's K/V in the pool's layout, one entry per block from the first."""

    @property
    def num_tokens(self) -> int: ...

    def blocks(self, first: int, last: int) -> object:
        """The data of blocks [first, last), in the layout ``KVLoad.data`` carries."""


class KVArrivals:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._arrived: dict[str, ArrivedKV] = {}

    def __len__(self) -> int:
        return len(self._arrived)

    def offer(self, request_id: str, kv: ArrivedKV) -> None:
        self._arrived[request_id] = kv

    def num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Tokens past the ``num_local_tokens`` prefix hits whose K/V arrived (0 when none did).
        The last token of a sequence always runs, to produce the logits of the next one."""
        kv = self._arrived.get(request.request_id)
        if kv is None:
            return 0
        return max(0, min(kv.num_tokens, request.num_tokens - 1) - num_local_tokens)

    def take_load(self, request: Request, block_table: list[int], num_local_tokens: int,
                  num_external_tokens: int) -> KVLoad:
        """The load that stores the arrived tokens into the request's blocks; the arrival is used up."""
        kv = self._arrived.pop(request.request_id)
        first = num_local_tokens // self.block_size  # hits are whole blocks
        last = -(-(num_local_tokens + num_external_tokens) // self.block_size)
        return KVLoad(tuple(block_table[first:last]), kv.blocks(first, last))

    def discard(self, request_id: str) -> None:
        self._arrived.pop(request_id, None)
