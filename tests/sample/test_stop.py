import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmosaic.sample.stop import StopStrings


def _feed_all(chunks: list[str], stops: list[str]) -> list[tuple[tuple[int, str] | None, int]]:
    """(hit, held back) after each chunk, fed to one matcher."""
    matcher = StopStrings(stops).matcher()
    return [(matcher.feed(chunk), matcher.held_back) for chunk in chunks]


def _hit(text: str, new_text_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The match the last ``new_text_len`` characters of ``text`` complete (the old text fed first)."""
    matcher = StopStrings(stops).matcher()
    matcher.feed(text[: len(text) - new_text_len])
    return matcher.feed(text[len(text) - new_text_len :])


def _held(text: str, stops: list[str]) -> int:
    matcher = StopStrings(stops).matcher()
    matcher.feed(text)
    return matcher.held_back


# ---------------------------------------------------------------- the old quadratic functions, as the reference
def _reference_find(text: str, new_text_len: int, stops: list[str]) -> tuple[int, str] | None:
    tail_start = len(text) - new_text_len
    best = None
    for stop in stops:
        pos = text.find(stop, max(0, tail_start - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def _reference_held(text: str, stops: list[str]) -> int:
    held = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:length]):
                held = length
                break
    return held


def test_stop_spanning_token_boundaries():
    assert [hit for hit, _ in _feed_all(["Hel", "lo wor", "ld"], ["lo w"])] == [None, (3, "lo w"), None]


def test_stop_starting_in_old_text():
    assert _hit("Hello", 2, ["ello"]) == (1, "ello")


def test_stop_entirely_in_new_text():
    assert _hit("abc", 3, ["b"]) == (1, "b")


def test_earliest_stop_wins_over_list_order():
    assert _hit("abc STOP def END", 16, ["END", "STOP"]) == (4, "STOP")


def test_a_longer_stop_starting_earlier_wins_over_one_ending_earlier():
    assert _hit("xabcd", 4, ["bc", "abcd"]) == (1, "abcd")


def test_equal_positions_pick_the_first_listed():
    assert _hit("xabc", 3, ["abc", "ab"]) == (1, "abc")
    assert _hit("xabc", 3, ["ab", "abc"]) == (1, "ab")


def test_old_matches_are_not_reported_again():
    assert _hit("STOP" + "x" * 100, 1, ["STOP"]) is None
    assert _hit("STOP" + "x" * 100, 100, ["STOP"]) is None  # it ended in the text fed before
    assert _hit("STOP" + "x" * 100, 101, ["STOP"]) == (0, "STOP")  # it ends in the new text


def test_overlapping_and_repeated_prefixes():
    assert _hit("aaab", 1, ["aab"]) == (1, "aab")
    assert _hit("abababc", 1, ["ababc"]) == (2, "ababc")
    assert [hit for hit, _ in _feed_all(["a", "b", "a", "b", "a", "c"], ["ababac"])][-1] == (0, "ababac")


def test_no_stops_or_no_match():
    assert _hit("hello", 5, []) is None
    assert _hit("hello", 5, ["xyz"]) is None
    assert _hit("", 0, ["a"]) is None


def test_held_back_length_for_partial_matches():
    assert _held("Hello wo", ["wor"]) == 2
    assert _held("Hello w", ["wor"]) == 1
    assert _held("Hello", ["lo w"]) == 2
    assert _held("xab", ["abc", "bcd"]) == 2
    assert _held("xab", ["bcd", "abx"]) == 2
    assert _held("aaab", ["aaaab"]) == 0
    assert _held("aaaa", ["aaaab"]) == 4


def test_held_back_text_is_exact_as_text_arrives():
    # "Hello wo" + "r" + "k": "wor" is held while it may become "world", then released.
    steps = _feed_all(["Hello wo", "r", "k"], ["world"])
    assert [held for _, held in steps] == [2, 3, 0]
    assert all(hit is None for hit, _ in steps)


def test_nothing_held_back_without_a_partial_match():
    assert _held("Hello", ["xyz"]) == 0
    assert _held("", ["abc"]) == 0
    assert _held("Hello", []) == 0
    assert _held("aaa", ["a"]) == 0  # one-char stops are never partial


def test_held_back_is_bounded_by_the_text():
    assert _held("ab", ["abcdef"]) == 2


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(["a", ""])


def test_long_stop_strings_cost_linear_time():
    # 16 stop strings of 40,000 characters, 16 sequences, 64 one-character steps: the old hold-back
    # compared each stop's prefixes one by one (seconds per step); this is a few ms for all of it.
    stops = [chr(ord("a") + i) * 39_999 + "!" for i in range(16)]
    strings = StopStrings(stops)
    matchers = [strings.matcher() for _ in range(16)]
    started = time.perf_counter()
    for step in range(64):
        for matcher in matchers:
            assert matcher.feed("a") is None
            assert matcher.held_back == step + 1
    assert time.perf_counter() - started < 1.0


# ---------------------------------------------------------------- the same answers as the old functions
_chunks = st.lists(st.text(alphabet="abc", max_size=5), max_size=12)
_stops = st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3)


@given(chunks=_chunks, stops=_stops)
def test_same_hits_and_held_back_as_the_quadratic_reference(chunks, stops):
    matcher = StopStrings(stops).matcher()
    text = ""
    for chunk in chunks:
        text += chunk
        hit = matcher.feed(chunk)
        assert hit == _reference_find(text, len(chunk), stops)
        if hit is not None:
            return
        assert matcher.held_back == _reference_held(text, stops)


@given(chunks=st.lists(st.text(max_size=6), max_size=10),
       stops=st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=4))
def test_same_streamed_text_as_the_reference_on_any_unicode(chunks, stops):
    """What a client would see streamed (text less the held-back tail), then the final text."""
    matcher = StopStrings(stops).matcher()
    text, ours, theirs = "", [], []
    for chunk in chunks:
        text += chunk
        hit, old_hit = matcher.feed(chunk), _reference_find(text, len(chunk), stops)
        assert hit == old_hit
        if hit is not None:
            ours.append(text[: hit[0]])
            theirs.append(text[: old_hit[0]])
            break
        ours.append(text[: len(text) - matcher.held_back])
        theirs.append(text[: len(text) - _reference_held(text, stops)])
    assert ours == theirs


@given(chunks=_chunks, stops=_stops)
def test_streaming_finds_the_first_stop_and_never_leaks_it(chunks, stops):
    matcher = StopStrings(stops).matcher()
    text, emitted = "", 0
    for chunk in chunks:
        text += chunk
        hit = matcher.feed(chunk)
        found = [(text.find(s), s) for s in stops if s in text]
        if hit is not None:
            # First detection: the earliest match anywhere in the text, and nothing streamed past it.
            assert hit[0] == min(pos for pos, _ in found)
            assert text.startswith(hit[1], hit[0])
            assert emitted <= hit[0]
            return
        assert not found
        emitted = max(emitted, len(text) - matcher.held_back)


# ---------------------------------------------------------------- through the engine: the same stream as before
def _streamed(stops: list[str]) -> list[tuple[str, str | None]]:
    """(text, finish reason) of each output of one greedy mock request: " t6 t12 t24 t48 t32 t0 t0 t0"."""
    from kvmosaic.engine.engine import Engine
    from kvmosaic.executor.mock import MockExecutor
    from kvmosaic.sampling_params import SamplingParams

    engine = Engine(executor=MockExecutor(num_device_blocks=8, block_size=4))
    engine.add_request(None, "t1 t2 t3", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8, stop=stops))
    outputs = []
    while engine.has_unfinished():
        outputs += [(o.outputs[0].text, o.outputs[0].finish_reason) for o in engine.step()]
    return outputs


def _reference_stream(texts: list[str], stops: list[str]) -> list[tuple[str, str | None]]:
    """What the old find_stop / trim_for_streaming made of the same token-by-token texts."""
    expected, previous = [], ""
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        hit = None if last else _reference_find(text, len(text) - len(previous), stops)
        if hit is not None:
            return expected + [(text[: hit[0]], "stop")]
        expected.append((text, "length") if last else (text[: len(text) - _reference_held(text, stops)], None))
        previous = text
    return expected


@pytest.mark.parametrize("stops", [["t24 t4"], ["t0 t0 t9"], ["t12 t2", "t48 t3", "x"],
                                   ["t6 t12 t24 t48 t32 t0 t0 t1"]])
def test_engine_streams_exactly_what_the_old_matcher_streamed(stops):
    texts = [text for text, _ in _streamed([])]
    assert texts[-1] == " t6 t12 t24 t48 t32 t0 t0 t0"
    assert _streamed(stops) == _reference_stream(texts, stops)
