"""Stop-string matching on incrementally detokenized text, in time linear in the text.

``StopStrings`` holds a request's stop strings with their KMP failure tables, built once and
shared by the request's sequences. Each sequence has a ``StopMatcher`` that remembers, for every
stop string, how many of its first characters the text so far ends with. Feeding the text a step
added moves those counts one character at a time, so a step costs O(new chars x stop strings)
amortized whatever the stop strings' lengths, and the text to hold back from a stream is the
largest count: no step rescans old text or compares a stop string's prefixes one by one.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """A request's stop strings and their failure tables."""

    __slots__ = ("stops", "_failures")

    def __init__(self, stops: Sequence[str]) -> None:
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = tuple(stops)
        self._failures = tuple(_failure_table(s) for s in self.stops)

    def matcher(self) -> StopMatcher:
        """A matcher for one sequence's text, starting empty."""
        return StopMatcher(self.stops, self._failures)


class StopMatcher:
    """Follows one sequence's growing text against the request's stop strings."""

    __slots__ = ("_stops", "_failures", "_matched", "_length")

    def __init__(self, stops: tuple[str, ...], failures: tuple[list[int], ...]) -> None:
        self._stops = stops
        self._failures = failures
        self._matched = [0] * len(stops)  # per stop: the longest prefix of it the text ends with
        self._length = 0  # characters fed so far

    def feed(self, new_text: str) -> tuple[int, str] | None:
        """Take the text just appended; return the earliest stop string ending inside it as (position
        in the whole text, stop string), or None. At equal positions the stop listed first wins.

        A stop that ended in earlier text was reported then, so only matches ending in ``new_text``
        count, including those that start in earlier text (across token boundaries)."""
        best: tuple[int, str] | None = None
        for i, stop in enumerate(self._stops):
            failure = self._failures[i]
            matched = self._matched[i]
            first_end = -1
            for offset, char in enumerate(new_text):
                while matched and stop[matched] != char:
                    matched = failure[matched - 1]
                if stop[matched] == char:
                    matched += 1
                if matched == len(stop):
                    if first_end < 0:
                        first_end = offset + 1
                    matched = failure[matched - 1]  # keep following the text: overlapping matches
            self._matched[i] = matched
            if first_end >= 0:
                position = self._length + first_end - len(stop)
                if best is None or position < best[0]:
                    best = (position, stop)
        self._length += len(new_text)
        return best

    @property
    def held_back(self) -> int:
        """How many characters at the end of the text to keep out of a stream: the longest suffix
        that begins some stop string (the next tokens may complete it, and then it is cut)."""
        return max(self._matched, default=0)


def _failure_table(pattern: str) -> list[int]:
    """KMP: for each prefix of ``pattern``, the length of its longest proper prefix that is also its suffix."""
    table = [0] * len(pattern)
    length = 0
    for i in range(1, len(pattern)):
        while length and pattern[i] != pattern[length]:
            length = table[length - 1]
        if pattern[i] == pattern[length]:
            length += 1
        table[i] = length
    return table
