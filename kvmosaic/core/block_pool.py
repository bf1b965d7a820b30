"""Device KV blocks: records, ref counts, an LRU free queue and the prefix-cache map.

A block with ``ref_count == 0`` sits in the free queue even if it still holds a
cached prefix: it stays findable by hash until ``allocate`` hands it out again,
and only then is its hash dropped (lazy eviction). Freed blocks join the tail and
allocation takes from the head, so the least recently freed cached block goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the cached tokens, checked on every hit


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # Insertion-ordered dict as an O(1) LRU queue: head = next to allocate.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_blocks)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue (ref_count 1 each)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, only {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced ones join the queue tail in the given order."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed more often than referenced")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each block (a cache hit or a fork)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_queue[block_id]
            block.ref_count += 1

    def cache_full_block(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Make a full block findable by its chained hash.

        The first block registered under a hash keeps it; a later duplicate (the
        same prefix computed twice) simply stays uncached.
        """
        if not self.enable_caching or block_hash in self._cached_blocks:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached_blocks[block_hash] = block_id

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly ``token_ids`` under ``block_hash``, if any."""
        block_id = self._cached_blocks.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their contents, only the index goes."""
        for block_id in self._cached_blocks.values():
            block = self.blocks[block_id]
            block.block_hash = None
            block.token_ids = None
        self._cached_blocks.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached_blocks.get(block.block_hash) == block.block_id:
            del self._cached_blocks[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1
