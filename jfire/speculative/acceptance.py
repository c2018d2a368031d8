"""How likely a draft token is to be kept, learned from the verify steps so far.

What a draft token's chance depends on most is what supports it. On the default model's
code-editing answers (scripts/bench_speculative.py's copy set) a token copied from the
request's own text behind a match of 8 tokens or more was kept 96-99% of the time, behind 4-7
tokens 94%, behind 2 or 3 tokens 89%; tokens from other requests' outputs 25-80% by class, on
few trials. So each draft token carries a key naming its support (its source and how
long the match behind it is, in a few length classes), and each key has its own estimate: a
count of trials and of tokens kept, both decayed at each new trial, so the estimate follows
the traffic as it changes. A key never seen starts from `prior`.

A verify step keeps a row's draft tokens up to the first refused one, so a token is a trial
only if every token before it was kept: a row that kept `a` of `d` tokens adds a keep to the
first `a` keys and, if a < d, a refusal to the next one.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

# The match lengths that start a new class: a match of 5 tokens is in class 4, of 70 in 64.
MATCH_CLASSES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def support(source: str, match: int) -> tuple[str, int]:
    """The key of a draft token from `source` ("own": the request's own text, "shared": other
    requests' outputs, "ngram": prompt lookup) behind a match of `match` tokens."""
    return source, max((c for c in MATCH_CLASSES if c <= match), default=0)


def position(j: int) -> tuple[str, int]:
    """The key of a draft model's j-th token (0 first): a chain's later tokens are kept less."""
    return "position", j


class Acceptance:
    def __init__(self, prior: float = 0.6, weight: float = 2.0, decay: float = 0.98):
        self.prior, self.weight, self.decay = prior, weight, decay
        self._counts: dict[Hashable, tuple[float, float]] = {}  # key -> (trials, kept), decayed

    def chance(self, key: Hashable) -> float:
        """The estimated chance that a token of this key is kept, given those before it were."""
        trials, kept = self._counts.get(key, (self.weight, self.weight * self.prior))
        return kept / trials

    def expected_tokens(self, keys: Sequence[Hashable]) -> float:
        """Tokens a verify row emits on average with draft tokens of these keys: the model's own
        token, plus each draft token's chance of being reached and kept."""
        total, reached = 1.0, 1.0
        for key in keys:
            reached *= self.chance(key)
            total += reached
        return total

    def record(self, keys: Sequence[Hashable], kept: int) -> None:
        """A verified row whose draft tokens had these keys kept the first `kept` of them."""
        for j, key in enumerate(keys[: kept + 1]):
            trials, accepted = self._counts.get(key, (self.weight, self.weight * self.prior))
            self._counts[key] = (trials * self.decay + 1, accepted * self.decay + (j < kept))
