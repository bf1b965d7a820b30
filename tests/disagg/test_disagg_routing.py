"""The decode worker a prefilled prompt goes to: the holder of its longest block run, else the least loaded."""

from __future__ import annotations

from kvmosaic.disagg.routing import PrefixRouter


def test_longest_run_holder_then_least_loaded():
    router = PrefixRouter(capacity=100)
    assert router.choose([1, 2, 3], alive=[0, 1], assigned=[]) == 0  # tie on load: the lowest id
    assert router.choose([7, 8], alive=[0, 1], assigned=[0]) == 1  # no shared block: the idle one
    assert router.choose([1, 2, 9], alive=[0, 1], assigned=[0, 1, 1]) == 0  # holds blocks 1, 2
    assert router.choose([7, 8, 3], alive=[0, 1], assigned=[]) == 0  # block 3's holder beats 8's
    assert router.choose([7, 8, 5], alive=[0, 1], assigned=[]) == 0  # 7 and 8 were routed to 0 last


def test_a_dead_holder_is_skipped_and_old_blocks_are_forgotten():
    router = PrefixRouter(capacity=2)
    assert router.choose([1, 2], alive=[0, 1], assigned=[1]) == 0
    assert router.choose([1, 2], alive=[1], assigned=[]) == 1  # worker 0 is gone
    router.choose([3, 4], alive=[0], assigned=[])  # pushes out blocks 1 and 2
    assert router.choose([1, 2], alive=[0, 1], assigned=[0]) == 1
