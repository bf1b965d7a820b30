"""Where a request's blocks come from beyond the local pool.

The KV manager allocates local blocks from its ``BlockPool`` and asks its allocator for the part
the local pool cannot hold. ``LocalAllocator`` has nothing more to give; a borrowing allocator
(``kvmosaic.distributed``) lends blocks of other instances, which show up in block tables as ids
>= the local pool size. ``is_local`` is the one predicate core/ asks: only local blocks are
prefix-cached, shared between forks, copied on write or swapped to the host tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmosaic.request import Request


class BlockAllocator:
    """The local pool only (the default)."""

    def __init__(self, num_local_blocks: int) -> None:
        self.num_local_blocks = num_local_blocks

    @property
    def num_extra_blocks(self) -> int:
        """Blocks one request could get beyond the local pool."""
        return 0

    def is_local(self, block_id: int) -> bool:
        return block_id < self.num_local_blocks

    def reserve(self, request: Request, num_blocks: int, num_free: int) -> list[int] | None:
        """Ids of the blocks beyond the ``num_free`` local ones that ``num_blocks`` new blocks need:
        [] when the local pool suffices, None when they cannot be had (nothing changes then)."""
        return [] if num_blocks <= num_free else None

    def release(self, block_ids: list[int]) -> None:
        """Give back blocks ``reserve`` returned."""
        if block_ids:
            raise ValueError(f"blocks {block_ids} are not from this allocator")
