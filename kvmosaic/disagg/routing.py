"""Where a prefilled prompt goes: the decode worker that already holds the longest run of its blocks
(so its prefix cache hits), else the one with the fewest requests."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class PrefixRouter:
    """Remembers, for the most recent ``capacity`` prompt blocks, which decode worker got them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._routes: OrderedDict[int, int] = OrderedDict()  # prompt block hash -> decode worker

    def choose(self, hashes: list[int], alive: list[int], assigned: Iterable[int]) -> int:
        """The live worker for a prompt of these block hashes (``assigned``: the worker of every live
        request), remembered for the prompts that share its blocks."""
        target = self._holder(hashes, alive, assigned)
        for h in hashes:
            self._routes[h] = target
            self._routes.move_to_end(h)
        while len(self._routes) > self.capacity:
            self._routes.popitem(last=False)
        return target

    def _holder(self, hashes: list[int], alive: list[int], assigned: Iterable[int]) -> int:
        for h in reversed(hashes):  # a block's hash covers every block before it
            target = self._routes.get(h)
            if target in alive:
                return target
        load = dict.fromkeys(alive, 0)
        for target in assigned:
            if target in load:
                load[target] += 1
        return min(alive, key=lambda d: (load[d], d))
