"""Stop strings: how many and how long a request may send, and the scan that finds them in its
output as the output grows.

The scan is an Aho-Corasick automaton over the request's stop strings. Its state after reading
the output is the longest suffix of the output that is a prefix of some stop, so each new
character costs amortized constant work however long the output or the stops are: the engine
thread never searches the whole output again. That state is also what a stream holds back (the
next tokens may complete a stop), and a stop is found the moment its last character is read.

The limits bound what a request's stops cost before its first token: the automaton has a node
per character of the stops. Real clients send a few short stops (Continue sends nine, each a
line marker of a few characters); 16 strings of up to 1,024 characters, 16 KiB in all, leave
them room many times over.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOPS = 16  # strings in a request's `stop`
MAX_STOP_CHARS = 1024  # characters in one stop string
MAX_STOP_BYTES = 16 << 10  # UTF-8 bytes of all of a request's stop strings together


def stop_limit_error(stops: Sequence[str]) -> str | None:
    """What is wrong with a request's stop strings (a sentence without the field's name), or None."""
    if len(stops) > MAX_STOPS:
        return f"at most {MAX_STOPS} strings, got {len(stops)}"
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            which = "this one" if len(stops) == 1 else f"string {i}"
            return f"a stop string is at most {MAX_STOP_CHARS} characters; {which} has {len(s)}"
    total = sum(len(s.encode("utf-8", errors="surrogatepass")) for s in stops)
    if total > MAX_STOP_BYTES:
        return f"the strings together are at most {MAX_STOP_BYTES} bytes of UTF-8; these have {total}"
    return None


class StopStrings:
    """The automaton of one set of stop strings, built once and shared by every request (and
    every choice of a request) that sends the same set: it never changes after it is built.
    Node 0 is the empty string; each node is a prefix of some stop."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.next: list[dict[str, int]] = [{}]  # the trie's edges
        self.depth = [0]  # the node's length in characters
        self.ends = [0]  # the longest stop that is a suffix of the node (0: none)
        for s in self.stops:
            node = 0
            for c in s:
                child = self.next[node].get(c)
                if child is None:
                    child = len(self.next)
                    self.next[node][c] = child
                    self.next.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.ends.append(0)
                node = child
            self.ends[node] = len(s)  # empty strings end nowhere: node 0 keeps 0
        # fail[n]: the longest proper suffix of node n that is also a node. Breadth first, so
        # every shorter node's link is known before it is needed.
        self.fail = [0] * len(self.next)
        order = list(self.next[0].values())
        for node in order:  # grows as it goes
            for c, child in self.next[node].items():
                self.fail[child] = self.step(self.fail[node], c)  # (the root's children keep 0)
                if not self.ends[child]:
                    self.ends[child] = self.ends[self.fail[child]]
                order.append(child)

    def step(self, node: int, c: str) -> int:
        """The node after reading character c in node."""
        while True:
            child = self.next[node].get(c)
            if child is not None:
                return child
            if node == 0:
                return 0
            node = self.fail[node]


class StopScan:
    """One request's scan of its growing output: `feed` it the output as it grows."""

    def __init__(self, automaton: StopStrings):
        self.automaton = automaton
        self.node = 0
        self.scanned = 0  # characters of the output read so far

    def feed(self, text: str) -> int | None:
        """Reads what `text` (the whole output so far, only ever appended to) added since the
        last call. Returns where the earliest stop in the output begins, or None while the
        output holds none (the caller ends the output there: nothing is read after a stop)."""
        a, node, earliest = self.automaton, self.node, None
        for i in range(self.scanned, len(text)):
            node = a.step(node, text[i])
            length = a.ends[node]
            # Keep reading to the end: a longer stop ending later may begin earlier.
            if length and (earliest is None or i + 1 - length < earliest):
                earliest = i + 1 - length
        self.node, self.scanned = node, len(text)
        return earliest

    @property
    def held(self) -> int:
        """Characters at the end of the output that may yet become a stop: the longest suffix
        that is a proper prefix of a stop (the output holds no whole stop, or it would have ended)."""
        return self.automaton.depth[self.node]
