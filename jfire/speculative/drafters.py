"""Model-free drafters: the tokens a request is likely to write next, guessed from text it or
earlier requests already hold.

Agent traffic copies a lot: an edit repeats most of the file it edits, a tool call repeats
names and arguments from the conversation, a retry repeats the previous answer. A draft that
continues the longest earlier occurrence of the request's last few tokens is then often
right, and costs no model.

- `ngram` (prompt lookup, as llama.cpp's lookup decoding and vLLM's `ngram`): the longest
  n-gram (max_n down to min_n tokens) ending the request's text that occurred before in it;
  the draft is what followed its latest occurrence.
- `suffix` (after SuffixDecoding, Oliaro et al. 2024): contexts of up to `depth` tokens, each
  with counts of the tokens that followed it, over the request's own text and over the
  outputs of the last `global_requests` finished requests. A draft grows token by token from
  the longest context found (the request's own first, then the shared one), taking the most
  frequent next token (the latest on ties); its length is capped by how long the match
  behind it is (a long match predicts a long copy) and by how the request's recent drafts
  fared.

Why not a library: Snowflake's `arctic-inference` holds SuffixDecoding's C++ suffix tree, but
it builds only from source against torch and vLLM; a context index in a few dozen lines of
Python costs microseconds a token here.

A drafter sees a `Sequence` (jfire.scheduler) and keeps its own per-request state, keyed by
request id: `propose(seq, k)` before a step, `observe(seq, proposed, accepted)` after it,
`finished(seq)` when the request ends.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

from jfire.errors import JfireError
from jfire.scheduler import Sequence

DRAFTERS = ("ngram", "suffix", "mtp", "eagle3")


class Drafter(Protocol):
    name: str

    def propose(self, seq: Sequence, k: int) -> list[int]: ...

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


class _Index:
    """The n-grams (1..depth tokens) of one token list, each with where it last ended and the
    counts of the tokens that followed it, extended as the list grows."""

    def __init__(self, depth: int):
        self.depth = depth
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence
        self.follow: dict[tuple[int, ...], collections.Counter] = {}

    def extend(self, tokens: list[int]) -> None:
        """Indexes tokens appended to the list since the last call (`tokens` is the whole list)."""
        for i in range(len(self.tokens), len(tokens)):
            token = tokens[i]
            # Every n-gram ending just before this token is followed by it.
            for n in range(1, min(self.depth, i) + 1):
                gram = tuple(tokens[i - n : i])
                self.follow.setdefault(gram, collections.Counter())[token] += 1
                self.last_end[gram] = i
            self.tokens.append(token)

    def latest(self, gram: tuple[int, ...]) -> int | None:
        """Where the latest occurrence of gram ended (the index of what followed it), or None."""
        return self.last_end.get(gram)

    def count(self, tokens: list[int], sign: int = 1) -> None:
        """Adds (sign 1) or takes back (-1) the follow counts of a standalone token list (an
        earlier request's output in the shared index; its positions are not kept)."""
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
        self._indexes: dict[str, _Index] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        index = self._indexes.setdefault(seq.request_id, _Index(self.max_n))
        tokens = seq.tokens
        # The index holds what followed each n-gram, so never the n-gram ending the text.
        index.extend(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = index.latest(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + k]
        return []

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        self._indexes.pop(seq.request_id, None)


@dataclasses.dataclass
class _Request:
    index: _Index
    limit: int  # the most tokens its next draft may have (adapted to how drafts fared)


@dataclasses.dataclass
class SuffixDrafter:
    """SuffixDecoding-style drafts from the request's own text and earlier requests' outputs."""

    depth: int = 6  # the longest context looked up
    min_match: int = 2  # the shortest context a draft token is taken from
    global_requests: int = 256  # finished outputs kept in the shared index
    # A draft at most this many times the match behind it. The default model's copying answers
    # (scripts/bench_speculative.py's copy set, one engine, one run each) decoded 87-92 tok/s
    # at 1x (a 2-token match drafted 2 tokens, nearly always all kept, in steps that could
    # have verified 8), 94.6 at 2x, 98-103 at 4x, 99-100 at 8x.
    match_factor: float = 4.0
    name: str = "suffix"

    def __post_init__(self):
        self._requests: dict[str, _Request] = {}
        self._shared = _Index(self.depth)
        self._shared_outputs: collections.deque[list[int]] = collections.deque()

    def propose(self, seq: Sequence, k: int) -> list[int]:
        state = self._requests.get(seq.request_id)
        if state is None:
            state = self._requests[seq.request_id] = _Request(_Index(self.depth), k)
        state.index.extend(seq.tokens)
        text = seq.tokens
        match = self._match_length(state.index, text)
        limit = min(k, state.limit, max(1, int(self.match_factor * max(match, self.min_match))))
        draft: list[int] = []
        while len(draft) < limit:
            token = self._next(state.index, text, draft)
            if token is None:
                break
            draft.append(token)
        return draft

    def _next(self, own: _Index, text: list[int], draft: list[int]) -> int | None:
        """The most frequent token after the longest context (own text first, then the shared
        outputs) ending text + draft."""
        tail = (text[-self.depth :] + draft)[-self.depth :]
        for n in range(len(tail), self.min_match - 1, -1):
            gram = tuple(tail[-n:])
            for index in (own, self._shared):
                counts = index.follow.get(gram)
                if counts:
                    return _most_frequent(counts)
        return None

    def _match_length(self, own: _Index, text: list[int]) -> int:
        """How far back the text's end matches its latest earlier occurrence in its own text
        (0 if its last `min_match` tokens never occurred before)."""
        if len(text) <= self.min_match:
            return 0
        end = own.latest(tuple(text[-self.min_match :]))  # never the text's end: nothing follows it yet
        if end is None:
            return self.min_match if self._shared.follow.get(tuple(text[-self.min_match :])) else 0
        n = 0
        while n < end and n < len(text) - 1 and text[end - 1 - n] == text[-1 - n] and n < 64:
            n += 1
        return n

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        state = self._requests.get(seq.request_id)
        if state is None or proposed == 0:
            return
        # Longer after a fully accepted draft, shorter after a rejected first token.
        if accepted == proposed:
            state.limit = state.limit + 1
        elif accepted == 0:
            state.limit = max(1, state.limit // 2)

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
