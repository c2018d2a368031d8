"""Model-free drafters: the tokens a request is likely to write next, guessed from text it or
earlier requests already hold.

Agent traffic copies a lot: an edit repeats most of the file it edits, a tool call repeats
names and arguments from the conversation, a retry repeats the previous answer. A draft that
continues an earlier occurrence of the request's last few tokens is then often right, and
costs no model.

- `ngram` (prompt lookup, as llama.cpp's lookup decoding and vLLM's `ngram`): the longest
  n-gram (max_n down to min_n tokens) ending the request's text that occurred before in it;
  the draft is what followed its latest occurrence.
- `suffix` (after SuffixDecoding, Oliaro et al. 2024): in the request's own text, the earlier
  occurrence that matches the most of the text's end (up to `max_match` tokens back, among the
  latest `candidates` occurrences of its last `min_match` tokens), and the draft is what
  followed it, the deepest match of a suffix tree over the text. A list repeats `<li>` after
  every item: the longest match finds the item the text is at, where the most frequent or the
  latest follower of a short context would not. Without such a match, the outputs of the last
  `global_requests` finished requests: contexts of up to `depth` tokens with counts of the
  tokens that followed them, the draft grown token by token from the longest context found,
  taking the most frequent follower.

A draft is as long as asked (`k`); how much of it a step verifies is the speculator's choice
(jfire.speculative.speculator), weighed by each token's support: the match behind it (the
match grows by one with each draft token it copies), its key in jfire.speculative.acceptance.

Why not a library: Snowflake's `arctic-inference` holds SuffixDecoding's C++ suffix tree, but
it builds only from source against torch and vLLM; the indexes here cost microseconds a token.

A drafter sees a `Sequence` (jfire.scheduler) and keeps its own per-request state, keyed by
request id: `propose(seq, k)` before a step (a `Draft`, or a plain token list where the tokens
have no support to tell: a draft model's), `observe(seq, proposed, accepted)` after it,
`finished(seq)` when the request ends.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable
from typing import Protocol

from jfire.errors import JfireError
from jfire.scheduler import Sequence
from jfire.speculative.acceptance import support

DRAFTERS = ("ngram", "suffix", "mtp", "eagle3")


@dataclasses.dataclass
class Draft:
    """Draft tokens and each one's support key (jfire.speculative.acceptance)."""

    tokens: list[int]
    keys: list[Hashable]


class Drafter(Protocol):
    name: str

    def propose(self, seq: Sequence, k: int) -> Draft | list[int]: ...

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None: ...

    def finished(self, seq: Sequence) -> None: ...


def make_drafter(name: str) -> Drafter:
    if name == "ngram":
        return NgramDrafter()
    if name == "suffix":
        return SuffixDrafter()
    if name in ("mtp", "eagle3"):
        return ModelDrafter(name)
    raise JfireError(f"unknown drafter {name!r}; use one of {', '.join(DRAFTERS)}")


class _LatestEnds:
    """Where each n-gram (1..depth tokens) of one token list last ended (the index of the token
    that followed it), extended as the list grows: prompt lookup's index."""

    def __init__(self, depth: int):
        self.depth = depth
        self.length = 0
        self.last_end: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        """Indexes tokens appended to the list since the last call (`tokens` is the whole list)."""
        for i in range(self.length, len(tokens)):
            for n in range(1, min(self.depth, i) + 1):
                self.last_end[tuple(tokens[i - n : i])] = i
        self.length = len(tokens)

    def latest(self, gram: tuple[int, ...]) -> int | None:
        """Where the latest occurrence of gram ended (the index of what followed it), or None."""
        return self.last_end.get(gram)


class _FollowCounts:
    """For each n-gram (1..depth tokens) of the token lists counted in, the counts of the tokens
    that followed it: the shared index over earlier requests' outputs."""

    def __init__(self, depth: int):
        self.depth = depth
        self.follow: dict[tuple[int, ...], collections.Counter] = {}

    def count(self, tokens: list[int], sign: int = 1) -> None:
        """Adds (sign 1) or takes back (-1) the follow counts of a token list (an earlier
        request's output; its positions are not kept)."""
        for i in range(1, len(tokens)):
            for n in range(1, min(self.depth, i) + 1):
                counts = self.follow.setdefault(tuple(tokens[i - n : i]), collections.Counter())
                counts[tokens[i]] += sign
                if counts[tokens[i]] <= 0:
                    del counts[tokens[i]]
                if not counts:
                    del self.follow[tuple(tokens[i - n : i])]


@dataclasses.dataclass
class NgramDrafter:
    """Prompt lookup: copy what followed the latest earlier occurrence of the text's last n-gram."""

    max_n: int = 4
    min_n: int = 2
    name: str = "ngram"

    def __post_init__(self):
        self._indexes: dict[str, _LatestEnds] = {}

    def propose(self, seq: Sequence, k: int) -> Draft:
        index = self._indexes.setdefault(seq.request_id, _LatestEnds(self.max_n))
        tokens = seq.tokens
        # The index holds what followed each n-gram, so never the n-gram ending the text.
        index.extend(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = index.latest(tuple(tokens[-n:]))
            if end is not None:
                draft = tokens[end : end + k]
                return Draft(draft, [support("ngram", n + j) for j in range(len(draft))])
        return Draft([], [])

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        self._indexes.pop(seq.request_id, None)


class _Occurrences:
    """One request's text, with where each `n`-gram of it ended (the index of the token that
    followed it), extended as the text grows."""

    def __init__(self, n: int):
        self.n = n
        self.length = 0
        self.ends: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)

    def extend(self, tokens: list[int]) -> None:
        # Never the n-gram ending the text: nothing follows it yet.
        for i in range(max(self.length, self.n), len(tokens)):
            self.ends[tuple(tokens[i - self.n : i])].append(i)
        self.length = len(tokens)

    def longest_match(self, tokens: list[int], max_match: int, candidates: int) -> tuple[int, int]:
        """(end, length) of the earlier occurrence matching the most of the text's end (the
        latest of equals; among the latest `candidates` occurrences of its last n tokens, at
        most `max_match` tokens back); (0, 0) if its last n tokens never occurred before."""
        best_end, best = 0, 0
        last = len(tokens) - 1
        for end in reversed(self.ends.get(tuple(tokens[-self.n :]), [])[-candidates:]):
            length = self.n
            while length < max_match and length < end and tokens[end - 1 - length] == tokens[last - length]:
                length += 1
            if length > best:
                best_end, best = end, length
        return best_end, best


@dataclasses.dataclass
class SuffixDrafter:
    """SuffixDecoding-style drafts: the continuation of the longest earlier match in the
    request's own text, else the most frequent followers in earlier requests' outputs."""

    min_match: int = 2  # the shortest match a draft continues
    max_match: int = 64  # how far back a match is followed
    candidates: int = 64  # the latest occurrences of the text's last min_match tokens compared
    depth: int = 6  # the longest context looked up in earlier requests' outputs
    global_requests: int = 256  # finished outputs kept in the shared index
    name: str = "suffix"

    def __post_init__(self):
        self._requests: dict[str, _Occurrences] = {}
        self._shared = _FollowCounts(self.depth)
        self._shared_outputs: collections.deque[list[int]] = collections.deque()

    def propose(self, seq: Sequence, k: int) -> Draft:
        own = self._requests.get(seq.request_id)
        if own is None:
            own = self._requests[seq.request_id] = _Occurrences(self.min_match)
        text = seq.tokens
        own.extend(text)
        end, match = own.longest_match(text, self.max_match, self.candidates)
        if match:
            # The copy runs on into the draft itself where it reaches the text's end (a repeat).
            draft: list[int] = []
            for j in range(k):
                draft.append(text[end + j] if end + j < len(text) else draft[end + j - len(text)])
            return Draft(draft, [support("own", match + j) for j in range(k)])
        return self._from_shared(text, k)

    def _from_shared(self, text: list[int], k: int) -> Draft:
        """Token by token, the most frequent follower of the longest context (text + draft so
        far) in earlier requests' outputs."""
        draft: list[int] = []
        keys: list[Hashable] = []
        while len(draft) < k:
            tail = (text[-self.depth :] + draft)[-self.depth :]
            for n in range(len(tail), self.min_match - 1, -1):
                counts = self._shared.follow.get(tuple(tail[-n:]))
                if counts:
                    draft.append(_most_frequent(counts))
                    keys.append(support("shared", n))
                    break
            else:
                break
        return Draft(draft, keys)

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        self._requests.pop(seq.request_id, None)
        output = seq.tokens[len(seq.prompt_ids) :]
        if len(output) <= self.min_match:
            return
        self._shared.count(output)
        self._shared_outputs.append(output)
        while len(self._shared_outputs) > self.global_requests:
            self._shared.count(self._shared_outputs.popleft(), -1)


def _most_frequent(counts: collections.Counter) -> int:
    """The token with the highest count; on ties the one counted first (dicts keep order)."""
    return max(counts.items(), key=lambda kv: kv[1])[0]


class ModelDrafter:
    """A draft model's tokens: computed by the engine's own programs after each step that
    touched the request (jfire.speculative.model_drafts) and kept on its `Sequence` by the
    runner; this hands them on."""

    def __init__(self, name: str):
        self.name = name

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return seq.model_draft[:k]

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        pass
