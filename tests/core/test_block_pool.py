import pytest

from kvmosaic.core.block_hash import hash_block_tokens, hash_request_blocks
from kvmosaic.core.block_pool import BlockPool


def _cache(pool: BlockPool, block_id: int, tokens: tuple[int, ...]) -> int:
    block_hash = hash_block_tokens(None, tokens)
    pool.cache_full_block(block_id, block_hash, tokens)
    return block_hash


# ------------------------------------------------------------------ block hash
def test_block_hash_is_stable_and_chained():
    assert hash_block_tokens(None, (1, 2)) == hash_block_tokens(None, (1, 2))
    assert hash_block_tokens(None, (1, 2)) != hash_block_tokens(None, (2, 1))
    root = hash_block_tokens(None, (1, 2))
    assert hash_block_tokens(root, (3, 4)) != hash_block_tokens(None, (3, 4))
    assert 0 <= root < 2**64


def test_hash_request_blocks_covers_full_blocks_and_resumes():
    tokens = [1, 2, 3, 4, 5, 6, 7]
    hashes = hash_request_blocks(tokens, 2)
    assert len(hashes) == 3  # the 7th token is in a partial block
    assert hashes[0] == hash_block_tokens(None, (1, 2))
    assert hashes[2] == hash_block_tokens(hash_block_tokens(hashes[0], (3, 4)), (5, 6))
    assert hash_request_blocks(tokens + [8], 2, hashes[:2]) == hashes + [hash_block_tokens(hashes[2], (7, 8))]
    # Known hashes are trusted, not recomputed.
    assert hash_request_blocks(tokens, 2, [11, 22, 33]) == [11, 22, 33]


# ------------------------------------------------------------------ block pool
def test_allocation_pops_from_the_head_in_order():
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free_blocks == 3
    assert [pool.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_freed_blocks_are_taken_again_before_unused_ones_the_last_freed_first():
    pool = BlockPool(8)
    pool.allocate(3)
    pool.free(reversed([0, 1, 2]))
    assert pool.num_free_blocks == 8
    assert pool.allocate(8) == [0, 1, 2, 3, 4, 5, 6, 7]
    pool.free([5, 2, 7])
    assert pool.allocate(2) == [7, 2]
    pool.free([0])
    assert pool.allocate(2) == [0, 5]


def test_blocks_holding_a_cached_prefix_are_taken_last_the_least_recently_freed_first():
    pool = BlockPool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.cache_full_block(1, block_hash=11, token_ids=(1, 2))
    pool.cache_full_block(3, block_hash=33, token_ids=(3, 4))
    pool.free([3, 1, 0, 2])
    # plain freed blocks (2 last freed), then the unused 4 and 5, then the cached ones: 3 before 1
    assert pool.allocate(4) == [2, 0, 4, 5]
    assert pool.lookup(33, (3, 4)) == 3 and pool.lookup(11, (1, 2)) == 1
    assert pool.allocate(1) == [3]
    assert pool.lookup(33, (3, 4)) is None and pool.lookup(11, (1, 2)) == 1
    assert pool.num_evictions == 1


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [2]


def test_double_free_raises():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError):
        pool.free([block])


def test_hash_hit_returns_the_same_block_and_verifies_tokens():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    block_hash = _cache(pool, block, (5, 6))
    assert pool.lookup(block_hash, (5, 6)) == block
    assert pool.lookup(block_hash, (5, 7)) is None  # same hash, other tokens: a collision is a miss
    pool.free([block])
    assert pool.lookup(block_hash, (5, 6)) == block  # freed blocks stay cached until reused
    pool.touch([block])
    assert pool.ref_count(block) == 1
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [1, 2, 3]  # the touched block left the free queue


def test_lru_evicts_the_least_recently_freed_cached_block():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = [_cache(pool, b, (b, b)) for b in blocks]
    for block in (1, 3, 0, 2):
        pool.free([block])
    assert pool.allocate(1) == [1]
    assert pool.num_evictions == 1
    assert pool.lookup(hashes[1], (1, 1)) is None
    assert pool.lookup(hashes[3], (3, 3)) == 3
    assert pool.allocate(1) == [3]
    assert pool.lookup(hashes[3], (3, 3)) is None
    assert pool.lookup(hashes[0], (0, 0)) == 0
    assert pool.num_cached_blocks == 2


def test_a_hit_protects_a_block_from_eviction():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [_cache(pool, b, (b,)) for b in blocks]
    pool.free(reversed(blocks))  # queue: 2, 1, 0
    pool.touch([2])  # a new request hits the oldest freed block
    assert pool.allocate(1) == [1]
    assert pool.lookup(hashes[2], (2,)) == 2


def test_ref_counts_with_sharing():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.touch([block])
    assert pool.ref_count(block) == 3
    pool.free([block])
    pool.free([block])
    assert pool.ref_count(block) == 1
    assert pool.num_free_blocks == 3
    pool.free([block])
    assert pool.num_free_blocks == 4


def test_first_block_under_a_hash_keeps_it():
    pool = BlockPool(3)
    first, second = pool.allocate(2)
    block_hash = _cache(pool, first, (9, 9))
    _cache(pool, second, (9, 9))
    assert pool.lookup(block_hash, (9, 9)) == first
    pool.free([second])
    pool.allocate(2)  # reusing `second` must not evict `first`'s entry
    assert pool.lookup(block_hash, (9, 9)) == first


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    block_hash = _cache(pool, block, (1,))
    assert pool.lookup(block_hash, (1,)) is None
    assert pool.num_cached_blocks == 0


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    hashes = [_cache(pool, b, (b,)) for b in blocks]
    pool.free([blocks[0]])
    pool.reset_prefix_cache()
    assert pool.lookup(hashes[0], (0,)) is None
    assert pool.lookup(hashes[1], (1,)) is None
    assert pool.num_cached_blocks == 0
    assert pool.ref_count(1) == 1
    assert pool.num_evictions == 0
