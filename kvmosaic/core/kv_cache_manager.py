"""Per-request block tables over the device pool, prefix caching, copy-on-write and the host swap tier.

The scheduler talks only to this class; the block pool stays private. The
manager decides which physical blocks hold which tokens and reports the block
moves (copy-on-write copies, swaps) the model runner must apply.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvmosaic.core.block_allocator import BlockAllocator
from kvmosaic.core.block_hash import hash_request_blocks
from kvmosaic.core.block_pool import BlockPool

if TYPE_CHECKING:
    from kvmosaic.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, num_host_blocks: int = 0, enable_prefix_caching: bool = True,
        allocator: BlockAllocator | None = None,
    ) -> None:
        """``allocator``: where blocks beyond the local pool come from (default: nowhere)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self._pool = BlockPool(num_blocks, enable_prefix_caching)
        self._block_tables: dict[str, list[int]] = {}
        # Chained hashes of each request's full blocks, and how many table blocks are registered.
        self._block_hashes: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self._free_host_blocks: deque[int] = deque(range(num_host_blocks))
        self._host_tables: dict[str, list[int]] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0
        self._allocator = allocator if allocator is not None else BlockAllocator(num_blocks)
        if self._allocator.num_local_blocks != num_blocks:
            raise ValueError(f"the allocator expects {self._allocator.num_local_blocks} local blocks, not {num_blocks}")

    # ----------------------------------------------------------------- capacity
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_blocks - self._pool.num_free_blocks

    @property
    def num_reachable_blocks(self) -> int:
        """Blocks one request could ever hold: the local pool plus what the allocator could add."""
        return self.num_blocks + self._allocator.num_extra_blocks

    def is_local(self, block_id: int) -> bool:
        """Local blocks can be prefix-cached, shared, copied on write and swapped; others cannot."""
        return self._allocator.is_local(block_id)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host_blocks)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_evictions(self) -> int:
        return self._pool.num_evictions

    def get_block_table(self, request_id: str) -> list[int]:
        return list(self._block_tables.get(request_id, ()))

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref_count(block_id)

    # ------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks matching the request's tokens from the start, and the tokens they hold.

        The block holding the last token is never reported: the model must run at
        least one token to produce the logits for the next one.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed, none served from the cache
        tokens = request.all_token_ids
        hashes = hash_request_blocks(tokens, self.block_size, self._block_hashes.get(request.request_id, ()))
        self._block_hashes[request.request_id] = hashes
        hit_blocks: list[int] = []
        for index in range((len(tokens) - 1) // self.block_size):
            start = index * self.block_size
            block_id = self._pool.lookup(hashes[index], tuple(tokens[start:start + self.block_size]))
            if block_id is None:
                break
            hit_blocks.append(block_id)
        num_hit_tokens = len(hit_blocks) * self.block_size
        self._num_queried_tokens += len(tokens)
        self._num_hit_tokens += num_hit_tokens
        return hit_blocks, num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self._num_hit_tokens / self._num_queried_tokens if self._num_queried_tokens else 0.0

    def prefix_cache_stats(self) -> dict[str, float]:
        return {"queries": self._num_queried_tokens, "hits": self._num_hit_tokens, "hit_rate": self.hit_rate}

    def reset_prefix_cache(self) -> None:
        self._pool.reset_prefix_cache()

    # --------------------------------------------------------------- allocation
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Grow the request's table to hold ``num_new_tokens`` more tokens; None (and no change) if it can't.

        ``new_computed_blocks`` are prefix-cache hits of a request being admitted;
        they start its table and count as computed tokens.
        """
        request_id = request.request_id
        hits = new_computed_blocks or []
        table = self._block_tables.get(request_id, [])
        if hits and table:
            raise ValueError(f"request {request_id} already has blocks; prefix hits apply only on admission")
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_total = num_computed + num_new_tokens
        num_fresh = max(0, _cdiv(num_total, self.block_size) - len(table) - len(hits))
        copy_indices = self._shared_blocks_to_write(table, num_computed, num_total)
        num_revived = sum(1 for block_id in hits if self._pool.ref_count(block_id) == 0)
        # copies and revived hits must be local; fresh blocks the local pool lacks come from the allocator
        free_for_fresh = self._pool.num_free_blocks - len(copy_indices) - num_revived
        if free_for_fresh < 0:
            return None
        borrowed = self._allocator.reserve(request, num_fresh, free_for_fresh)
        if borrowed is None:
            return None

        if hits:
            # Touch before allocating so the hits are not handed out as fresh blocks.
            self._pool.touch(hits)
            table = list(hits)
            self._num_registered[request_id] = len(hits)
        for index in copy_indices:
            self._copy_on_write(table, index)
        table.extend(self._pool.allocate(num_fresh - len(borrowed)))
        table.extend(borrowed)
        self._block_tables[request_id] = table
        self._register_full_blocks(request, table, num_total)
        return list(table)

    def _shared_blocks_to_write(self, table: list[int], num_computed: int, num_total: int) -> list[int]:
        """Indices of existing blocks the new tokens land in that another sequence also references."""
        first = num_computed // self.block_size
        last = min(len(table), _cdiv(num_total, self.block_size))
        return [index for index in range(first, last)
                if self.is_local(table[index]) and self._pool.ref_count(table[index]) > 1]

    def _copy_on_write(self, table: list[int], index: int) -> None:
        src = table[index]
        (dst,) = self._pool.allocate(1)
        self._pending_copies.append((src, dst))
        self._pool.free([src])
        table[index] = dst

    def _register_full_blocks(self, request: Request, table: list[int], num_total: int) -> None:
        """Index every block filled by the tokens known so far, hashing only blocks not hashed before."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        tokens = request.all_token_ids
        num_full = min(num_total, len(tokens)) // self.block_size
        hashes = self._block_hashes.get(request_id, [])
        if len(hashes) < num_full:
            # Hashing every full block of the known tokens is fine: they never change.
            hashes = hash_request_blocks(tokens, self.block_size, hashes)
            self._block_hashes[request_id] = hashes
        for index in range(self._num_registered.get(request_id, 0), num_full):
            if not self.is_local(table[index]):
                continue
            start = index * self.block_size
            self._pool.cache_full_block(table[index], hashes[index], tuple(tokens[start:start + self.block_size]))
        self._num_registered[request_id] = max(num_full, self._num_registered.get(request_id, 0))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must apply before the next forward pass, in order."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # --------------------------------------------------------- request lifetime
    def free(self, request: Request) -> None:
        """Release everything the request holds on both tiers."""
        request_id = request.request_id
        table = self._block_tables.pop(request_id, None)
        if table:
            self._allocator.release([block_id for block_id in table if not self.is_local(block_id)])
            table = [block_id for block_id in table if self.is_local(block_id)]
        if table:
            # Reverse order: the request's tail blocks are evicted before its shared-prefix head.
            self._pool.free(reversed(table))
        self._block_hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._free_host_blocks.extend(self._host_tables.pop(request_id, ()))

    def free_uncomputed_blocks(self, request: Request) -> None:
        """Free the table's blocks past the request's computed tokens (after a rollback they hold
        only rejected speculative tokens). None of them is registered in the prefix cache: block
        hashes cover ``all_token_ids``, and a rollback never goes below the tokens known then."""
        table = self._block_tables.get(request.request_id)
        num_kept = _cdiv(request.num_computed_tokens, self.block_size)
        if not table or len(table) <= num_kept:
            return
        tail = table[num_kept:]
        del table[num_kept:]
        self._allocator.release([block_id for block_id in tail if not self.is_local(block_id)])
        self._pool.free(reversed([block_id for block_id in tail if self.is_local(block_id)]))
        registered = self._num_registered.get(request.request_id, 0)
        self._num_registered[request.request_id] = min(registered, num_kept)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; writes into shared blocks copy first."""
        table = self._block_tables.get(parent.request_id, [])
        if not all(self.is_local(block_id) for block_id in table):
            raise ValueError(f"request {parent.request_id} holds blocks of another pool and cannot be forked")
        self._pool.touch(table)
        self._block_tables[child.request_id] = list(table)
        num_registered = self._num_registered.get(parent.request_id, 0)
        # Only registered blocks are known to hold tokens the two sequences share.
        self._block_hashes[child.request_id] = self._block_hashes.get(parent.request_id, [])[:num_registered]
        self._num_registered[child.request_id] = num_registered

    # ---------------------------------------------------------------- swapping
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host tier: (device, host) pairs, or None if the host is full."""
        request_id = request.request_id
        table = self._block_tables.get(request_id, [])
        if len(table) > len(self._free_host_blocks) or not all(self.is_local(block_id) for block_id in table):
            return None  # blocks of another pool are not swapped: the caller recomputes instead
        host_blocks = [self._free_host_blocks.popleft() for _ in table]
        self._host_tables[request_id] = host_blocks
        self._block_tables.pop(request_id, None)
        self._pool.free(reversed(table))
        # The device copies may be reused; the swapped-in blocks are registered afresh.
        self._num_registered[request_id] = 0
        return list(zip(table, host_blocks))

    def swap_in(self, request: Request, num_new_tokens: int = 0) -> list[tuple[int, int]] | None:
        """Bring the request's blocks back: (host, device) pairs, or None if the device lacks room.

        ``num_new_tokens`` reserves room for the tokens to run right after, so the
        following ``allocate_slots`` cannot fail.
        """
        request_id = request.request_id
        host_blocks = self._host_tables[request_id]
        num_total = request.num_computed_tokens + num_new_tokens
        num_needed = max(len(host_blocks), _cdiv(num_total, self.block_size))
        if num_needed > self._pool.num_free_blocks:
            return None
        device_blocks = self._pool.allocate(len(host_blocks))
        del self._host_tables[request_id]
        self._free_host_blocks.extend(host_blocks)
        self._block_tables[request_id] = device_blocks
        return list(zip(host_blocks, device_blocks))

    # ----------------------------------------------- lending (blocks for another pool's requests)
    def lend_blocks(self, num_blocks: int) -> list[int] | None:
        """Reserve free local blocks for another instance's request; None if there are not enough."""
        if num_blocks > self._pool.num_free_blocks:
            return None
        return self._pool.allocate(num_blocks)

    def reclaim_blocks(self, block_ids: list[int]) -> None:
        """Lent blocks come back to the local pool."""
        self._pool.free(block_ids)

    def replace_blocks(self, mapping: dict[int, int]) -> None:
        """Rewrite block-table entries everywhere (a borrowed block brought home becomes a local one)."""
        for request_id, table in self._block_tables.items():
            if mapping.keys() & set(table):
                self._block_tables[request_id] = [mapping.get(block_id, block_id) for block_id in table]

    def requests_holding(self, block_ids: set[int]) -> set[str]:
        """Requests whose tables hold any of these blocks."""
        return {r for r, table in self._block_tables.items() if block_ids.intersection(table)}

    def num_table_blocks(self) -> int:
        """Blocks in all block tables (shared ones counted per table)."""
        return sum(len(table) for table in self._block_tables.values())
