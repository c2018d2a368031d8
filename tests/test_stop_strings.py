"""Stop strings: the output scan (jfire/stop_strings.py, used by jfire/outputs.py) against the
plain definitions it replaced (search the whole output for each stop, then try every suffix
against every stop's prefixes), on random outputs and stops; and the limits on what a request
may send."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from jfire.outputs import LiveRequest, output_text
from jfire.stop_strings import MAX_STOP_BYTES, MAX_STOP_CHARS, MAX_STOPS, StopScan, StopStrings, stop_limit_error


def naive_find_stop(text: str, stops) -> int | None:
    """Where the earliest stop begins in text, or None."""
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def naive_holdback(text: str, stops) -> int:
    """The longest suffix of text that is a proper prefix of some stop."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def naive_output_text(state, chunk: str, tail: str, finish: str | None, stops) -> tuple[str, str | None]:
    """What jfire/outputs.py sent for one token before the scan: the same steps, with the
    whole output searched at every token."""
    state.text += chunk
    if finish is not None:
        state.text += tail
    cut = naive_find_stop(state.text, stops)
    if cut is not None:
        state.text, finish = state.text[:cut], "stop"
    safe = len(state.text) if finish else len(state.text) - naive_holdback(state.text, stops)
    delta, state.emitted = state.text[state.emitted : safe], max(state.emitted, safe)
    return delta, finish


class ChunkDecoder:
    """A stream decoder whose token t decodes to chunks[t], with `tail` left for the flush."""

    def __init__(self, chunks: list[str], tail: str):
        self.chunks, self.tail = chunks, tail

    def push(self, token: int) -> str:
        return self.chunks[token]

    def flush(self) -> str:
        tail, self.tail = self.tail, ""
        return tail


def scan_of(stops) -> StopScan:
    return StopScan(StopStrings(stops))


def scan_cut_and_held(text: str, stops) -> tuple[int | None, int]:
    scan = scan_of(stops)
    return scan.feed(text), scan.held


# Few letters, so stops overlap each other and the output often.
TEXT = st.text(alphabet="ab<|\n", max_size=5)
STOPS = st.lists(st.text(alphabet="ab<|\n", min_size=1, max_size=6), min_size=1, max_size=MAX_STOPS)


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(stops=STOPS, chunks=st.lists(TEXT, min_size=1, max_size=40), tail=TEXT, ends_by_length=st.booleans())
def test_the_scan_sends_what_searching_the_whole_output_sent(stops, chunks, tail, ends_by_length):
    """Token by token, the same text is sent, the same tail held back, and the output ends at
    the same place for the same reason."""
    live = LiveRequest(None, None, None, ChunkDecoder(chunks, tail), stops=scan_of(stops))  # type: ignore[arg-type]
    naive = SimpleNamespace(text="", emitted=0)
    for token, chunk in enumerate(chunks):
        finish = "length" if ends_by_length and token == len(chunks) - 1 else None
        got = output_text(live, token, False, finish)
        want = naive_output_text(naive, chunk, tail, finish, stops)
        assert got == want, (token, live.text, naive.text)
        assert (live.text, live.emitted) == (naive.text, naive.emitted)
        if want[1] is not None:
            break


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(stops=STOPS, pieces=st.lists(TEXT, min_size=1, max_size=40))
def test_the_scan_finds_the_earliest_stop_and_holds_the_longest_prefix(stops, pieces):
    scan, text = scan_of(stops), ""
    for piece in pieces:
        text += piece
        cut = scan.feed(text)
        assert cut == naive_find_stop(text, stops), text
        if cut is not None:  # the output ends there: nothing more is read
            return
        assert scan.held == naive_holdback(text, stops), text


def test_the_cases_the_plain_definitions_were_tested_with():
    assert scan_cut_and_held("hello world", ["wor", "lo"])[0] == 3
    assert scan_cut_and_held("hello world", ["xyz"])[0] is None
    assert scan_cut_and_held("a<|im_end|>b", ["<|im_end|>"])[0] == 1
    assert scan_cut_and_held("hello <|im", ["<|im_end|>"]) == (None, 4)
    assert scan_cut_and_held("hello", ["<|im_end|>"]) == (None, 0)
    assert scan_cut_and_held("ab", ["abc"]) == (None, 2)
    assert scan_cut_and_held("", ["abc"]) == (None, 0)
    assert scan_cut_and_held("xx\n", ["\n\n", "User:"]) == (None, 1)
    # A longer stop that ends later but begins earlier wins.
    assert scan_cut_and_held("xabcd", ["bc", "abcd"])[0] == 1


def test_the_scan_is_linear_in_the_output():
    """The most stops of the longest kind, against an output that matches only their first
    letter: trying every suffix against every prefix took 4.4 ms a token here (22 s for these
    5,000 tokens); the scan reads each new character once."""
    stops = [("ab" * MAX_STOP_CHARS)[: MAX_STOP_CHARS - 1] + chr(ord("c") + i) for i in range(MAX_STOPS)]
    live = LiveRequest(None, None, None, ChunkDecoder(["aaaa"], ""), stops=scan_of(stops))  # type: ignore[arg-type]
    t0 = time.perf_counter()
    for _ in range(5_000):  # 20,000 characters, four a token
        assert output_text(live, 0, False, None)[1] is None
    assert time.perf_counter() - t0 < 2.0
    assert live.stops.held == 1 and live.emitted == 19_999  # the last "a" may begin a stop


def test_the_limits_on_what_a_request_sends():
    assert stop_limit_error(["\n\n", "```", "/src/", "# End of file"] * 4) is None  # 16 short ones
    assert "at most 16 strings, got 17" in stop_limit_error(["x"] * 17)
    assert stop_limit_error(["x" * MAX_STOP_CHARS]) is None
    assert "at most 1024 characters; this one has 20000" in stop_limit_error(["x" * 20_000])
    assert "string 2 has 1025" in stop_limit_error(["a", "b", "x" * 1025])
    four_bytes = "\U0001f600" * (MAX_STOP_CHARS // 2)  # 2,048 bytes a string
    assert stop_limit_error([four_bytes] * (MAX_STOP_BYTES // 2048)) is None
    assert f"at most {MAX_STOP_BYTES} bytes" in stop_limit_error([four_bytes] * (MAX_STOP_BYTES // 2048) + ["x"])
