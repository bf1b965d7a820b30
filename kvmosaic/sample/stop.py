"""Stop-string matching on incrementally detokenized text."""

from __future__ import annotations


def find_stop(text: str, new_text_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest (position, stop string) of a stop string in text that involves the new tail.

    text is the whole output so far; its last new_text_len chars were just added. A match that
    could not have been seen before must end inside the new tail, so for each stop s only
    text[len(text) - new_text_len - len(s) + 1:] is searched: matches spanning token boundaries
    are found while the work stays O(new_text_len + max stop length) per stop. When several
    stops match, the smallest position wins; at equal positions, the one listed first.
    """
    tail_start = len(text) - new_text_len
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, max(0, tail_start - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def trim_for_streaming(text: str, stops: list[str]) -> int:
    """How many chars at the end of text to hold back from a stream: the longest suffix of text
    that is a proper prefix of some stop string (0 if none).

    The next tokens may complete that stop string, and then the text from its start is cut, so
    emitting those chars now would leak part of a stop string. Complete matches are find_stop's
    job: call this on text in which find_stop found nothing.
    """
    held = 0
    for stop in stops:
        # Longest first: the first prefix that text ends with is this stop's answer.
        for length in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:length]):
                held = length
                break
    return held
