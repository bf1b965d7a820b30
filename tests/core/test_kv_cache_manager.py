import pytest

from kvmosaic.core.kv_cache_manager import KVCacheManager
from kvmosaic.request import Request
from kvmosaic.sampling_params import SamplingParams


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(), arrival_time=0.0)


def _admit(kv: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: prefix lookup, allocation, progress."""
    hits, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    table = kv.allocate_slots(request, num_new, hits)
    if table is not None:
        request.num_computed_tokens = num_hit + num_new
    return table


def test_allocation_covers_the_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(9)))
    assert _admit(kv, a) == [0, 1, 2]
    assert kv.get_block_table("a") == [0, 1, 2]
    assert kv.num_used_blocks == 3
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    a.append_output_token(9)
    assert kv.allocate_slots(a, 1) == [0, 1, 2]  # position 9 still fits block 2
    kv.free(a)
    assert kv.num_free_blocks == 8
    assert kv.get_block_table("a") == []


def test_prompt_of_exactly_two_full_blocks_gets_one_computed_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(8)))
    assert _admit(kv, a) == [0, 1]
    kv.free(a)  # free queue now: 2 3 4 5 6 7 1 0
    b = _request("b", list(range(8)))
    assert kv.get_computed_blocks(b) == ([0], 4)  # block 1 holds the last token: never a hit
    assert kv.allocate_slots(b, 4, [0]) == [0, 2]
    assert kv.prefix_cache_stats() == {"queries": 16, "hits": 4, "hit_rate": 0.25}


def test_one_more_token_makes_both_blocks_hit():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _admit(kv, _request("a", list(range(8))))
    c = _request("c", list(range(9)))
    assert kv.get_computed_blocks(c) == ([0, 1], 8)
    assert kv.allocate_slots(c, 1, [0, 1]) == [0, 1, 2]
    assert kv.ref_count(0) == 2 and kv.ref_count(1) == 2
    kv.free(c)
    assert kv.ref_count(0) == 1 and kv.num_free_blocks == 6


def test_decode_registers_blocks_as_they_fill():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = _request("a", [1, 2, 3])
    assert _admit(kv, a) == [0, 1]
    assert kv.get_computed_blocks(_request("x", [1, 2, 3, 4, 5])) == ([0], 2)  # block 1 is partial
    a.append_output_token(4)
    assert kv.allocate_slots(a, 1) == [0, 1]
    a.num_computed_tokens += 1
    assert kv.get_computed_blocks(_request("y", [1, 2, 3, 4, 5])) == ([0, 1], 4)
    assert kv.get_computed_blocks(_request("z", [1, 2, 3, 9, 5])) == ([0], 2)


def test_allocate_slots_failure_leaves_state_unchanged():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert _admit(kv, _request("a", list(range(8)))) == [0, 1]
    b = _request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1
    assert kv.get_block_table("b") == []
    assert kv.allocate_slots(b, 4) == [2]


def test_reviving_cached_free_blocks_counts_against_capacity():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    assert _admit(kv, _request("x", [7, 7])) == [0]
    a = _request("a", [1, 2, 3, 4])
    assert _admit(kv, a) == [1, 2]
    kv.free(a)  # blocks 2, 1 are free but still cached
    b = _request("b", [1, 2, 3, 4, 5, 6])
    hits, num_hit = kv.get_computed_blocks(b)
    assert (hits, num_hit) == ([1, 2], 4)
    # Two revived hits + one fresh block > two free blocks.
    assert kv.allocate_slots(b, 2, hits) is None
    assert kv.num_free_blocks == 2
    assert kv.ref_count(1) == 0 and kv.ref_count(2) == 0
    assert kv.get_computed_blocks(b) == ([1, 2], 4)
    kv.free(_request("x", [7, 7]))
    assert kv.allocate_slots(b, 2, hits) == [1, 2, 0]


def test_copy_on_write_after_fork():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = _request("p", [10, 11, 12, 13, 14, 15])
    assert _admit(kv, parent) == [0, 1]
    parent.append_output_token(100)
    child = parent.fork("p#1", 1, 200, None)
    kv.fork(parent, child)
    assert kv.get_block_table("p#1") == [0, 1]
    assert kv.ref_count(0) == 2 and kv.ref_count(1) == 2
    # Both write position 6, inside the shared partial block 1: the first writer copies.
    assert kv.allocate_slots(parent, 1) == [0, 2]
    assert kv.ref_count(1) == 1
    assert kv.allocate_slots(child, 1) == [0, 1]  # now the sole owner: writes in place
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.take_pending_copies() == []
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = _request("p", list(range(8)))
    _admit(kv, parent)
    parent.append_output_token(100)
    child = parent.fork("p#1", 1, 200, None)
    kv.fork(parent, child)
    assert kv.allocate_slots(parent, 1) == [0, 1, 2]
    assert kv.allocate_slots(child, 1) == [0, 1, 3]
    assert kv.take_pending_copies() == []


def test_copy_on_write_needs_a_free_block():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent = _request("p", [1, 2, 3, 4, 5, 6])
    _admit(kv, parent)
    parent.append_output_token(7)
    child = parent.fork("p#1", 1, 8, None)
    kv.fork(parent, child)
    assert kv.allocate_slots(parent, 1) is None
    assert kv.get_block_table("p") == [0, 1] and kv.ref_count(1) == 2
    assert kv.take_pending_copies() == []


def test_swap_out_and_in():
    kv = KVCacheManager(num_blocks=4, block_size=2, num_host_blocks=4)
    a = _request("a", [1, 2, 3])
    assert _admit(kv, a) == [0, 1]
    assert kv.swap_out(a) == [(0, 0), (1, 1)]
    assert kv.get_block_table("a") == []
    assert kv.num_free_blocks == 4 and kv.num_free_host_blocks == 2
    # free after the swap: 1 (freed, no cached prefix), then 2 and 3 (never used), then 0 (cached)
    assert _admit(kv, _request("b", [5, 6])) == [1]
    a.append_output_token(4)
    assert kv.swap_in(a, 1) == [(0, 2), (1, 3)]
    assert kv.num_free_host_blocks == 4
    assert kv.allocate_slots(a, 1) == [2, 3]


def test_swap_out_fails_when_the_host_is_full():
    kv = KVCacheManager(num_blocks=4, block_size=2, num_host_blocks=1)
    a = _request("a", [1, 2, 3])
    _admit(kv, a)
    assert kv.swap_out(a) is None
    assert kv.get_block_table("a") == [0, 1]
    assert kv.num_free_blocks == 2 and kv.num_free_host_blocks == 1


def test_swap_in_reserves_room_for_the_next_tokens():
    kv = KVCacheManager(num_blocks=3, block_size=2, num_host_blocks=4)
    a = _request("a", [1, 2, 3, 4])
    _admit(kv, a)
    kv.swap_out(a)
    _admit(kv, _request("b", [5, 6]))
    a.append_output_token(9)
    assert kv.swap_in(a, 1) is None  # 2 blocks back + 1 for position 4 > 2 free
    assert kv.num_free_host_blocks == 2 and kv.num_free_blocks == 2
    assert kv.swap_in(a, 0) == [(0, 1), (1, 0)]  # free queue after the swap out: 2 1 0, then b took 2


def test_free_releases_host_blocks_of_a_swapped_request():
    kv = KVCacheManager(num_blocks=4, block_size=2, num_host_blocks=2)
    a = _request("a", [1, 2, 3])
    _admit(kv, a)
    kv.swap_out(a)
    kv.free(a)
    assert kv.num_free_host_blocks == 2 and kv.num_free_blocks == 4


def test_caching_disabled():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = _request("a", [1, 2, 3])
    _admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(_request("b", [1, 2, 3])) == ([], 0)
    assert kv.prefix_cache_stats() == {"queries": 0, "hits": 0, "hit_rate": 0.0}


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    _admit(kv, _request("a", [1, 2, 3]))
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_request("b", [1, 2, 3])) == ([], 0)
