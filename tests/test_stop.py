from hypothesis import given
from hypothesis import strategies as st

from kvmosaic.sample.stop import find_stop, trim_for_streaming


def _stream(chunks: list[str], stops: list[str]) -> list[tuple[int, str] | None]:
    text, hits = "", []
    for chunk in chunks:
        text += chunk
        hits.append(find_stop(text, len(chunk), stops))
    return hits


def test_stop_spanning_token_boundaries():
    assert _stream(["Hel", "lo wor", "ld"], ["lo w"]) == [None, (3, "lo w"), None]


def test_stop_starting_in_old_text():
    assert find_stop("Hello", 2, ["ello"]) == (1, "ello")


def test_stop_entirely_in_new_text():
    assert find_stop("abc", 3, ["b"]) == (1, "b")


def test_earliest_stop_wins_over_list_order():
    assert find_stop("abc STOP def END", 16, ["END", "STOP"]) == (4, "STOP")


def test_equal_positions_pick_the_first_listed():
    assert find_stop("xabc", 3, ["abc", "ab"]) == (1, "abc")
    assert find_stop("xabc", 3, ["ab", "abc"]) == (1, "ab")


def test_old_matches_are_outside_the_search_window():
    # A match that ends before the new tail was reported on an earlier step.
    assert find_stop("STOP" + "x" * 100, 1, ["STOP"]) is None
    assert find_stop("STOP" + "x" * 100, 101, ["STOP"]) == (0, "STOP")


def test_no_stops_or_no_match():
    assert find_stop("hello", 5, []) is None
    assert find_stop("hello", 5, ["xyz"]) is None
    assert find_stop("", 0, ["a"]) is None


def test_held_back_length_for_partial_matches():
    assert trim_for_streaming("Hello wo", ["wor"]) == 2
    assert trim_for_streaming("Hello w", ["wor"]) == 1
    assert trim_for_streaming("Hello", ["lo w"]) == 2
    assert trim_for_streaming("xab", ["abc", "bcd"]) == 2
    assert trim_for_streaming("xab", ["bcd", "abx"]) == 2


def test_nothing_held_back_without_a_partial_match():
    assert trim_for_streaming("Hello", ["xyz"]) == 0
    assert trim_for_streaming("", ["abc"]) == 0
    assert trim_for_streaming("Hello", []) == 0
    assert trim_for_streaming("aaa", ["a"]) == 0  # one-char stops are never partial


def test_held_back_is_bounded_by_the_text():
    assert trim_for_streaming("ab", ["abcdef"]) == 2


_chunks = st.lists(st.text(alphabet="abc", max_size=5), max_size=12)
_stops = st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3)


@given(chunks=_chunks, stops=_stops)
def test_streaming_finds_the_first_stop_and_never_leaks_it(chunks, stops):
    text, emitted = "", 0
    for chunk in chunks:
        text += chunk
        hit = find_stop(text, len(chunk), stops)
        found = [(text.find(s), s) for s in stops if s in text]
        if hit is not None:
            # First detection: the earliest match anywhere in the text, and nothing streamed past it.
            assert hit[0] == min(pos for pos, _ in found)
            assert text.startswith(hit[1], hit[0])
            assert emitted <= hit[0]
            return
        assert not found
        emitted = max(emitted, len(text) - trim_for_streaming(text, stops))
