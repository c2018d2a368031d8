"""The model-free drafters' proposals and the speculator's choice of verify program, each against
a brute-force recomputation from its definition: the suffix drafter's draft continues the
earlier occurrence with the longest match, the expected tokens of a draft are the mean over
its outcomes, and the chosen program is the one expected to emit the most tokens a second."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jfire.sampling import SamplingParams
from jfire.scheduler import Sequence
from jfire.speculative.acceptance import Acceptance, support
from jfire.speculative.drafters import Draft, SuffixDrafter
from jfire.speculative.speculator import Speculator


def sequence(request_id: str, prompt: list[int]) -> Sequence:
    return Sequence(request_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True), 0)


def longest_match_draft(text: list[int], k: int, min_match: int, max_match: int) -> tuple[list[int], int]:
    """The draft by definition: of every earlier position where the text's last min_match tokens
    occurred, the one whose preceding tokens match the most of the text's end (at most
    max_match; the latest of equals), and the k tokens that followed it, running on into the
    draft itself past the text's end."""
    best_end, best = None, 0
    for end in range(min_match, len(text)):
        length = 0
        while length < min(max_match, end) and text[end - 1 - length] == text[len(text) - 1 - length]:
            length += 1
        if length >= min_match and length >= best:
            best_end, best = end, length
    if best_end is None:
        return [], 0
    copied = list(text)
    for j in range(k):
        copied.append(copied[best_end + j])
    return copied[len(text) :], best


def test_suffix_drafts_continue_the_longest_earlier_match():
    """Texts over a 4-token vocabulary with repeats, grown a token at a time (the index extended
    as a request's text grows), every draft and its support against the definition."""
    rng = np.random.RandomState(3)
    checked = 0
    for trial in range(20):
        phrase = list(rng.randint(0, 4, size=12))
        text = phrase * 3 + list(rng.randint(0, 4, size=30))
        drafter = SuffixDrafter(max_match=16, candidates=10_000)
        seq = sequence(f"r{trial}", text[:3])
        for n in range(3, len(text) + 1):
            seq.tokens = text[:n]
            got = drafter.propose(seq, 6)
            want, match = longest_match_draft(text[:n], 6, drafter.min_match, drafter.max_match)
            assert got.tokens == want, (trial, n)
            assert got.keys == ([support("own", match + j) for j in range(6)] if want else [])
            checked += bool(want)
    assert checked > 500


def test_suffix_drafts_from_earlier_outputs_without_a_match_of_its_own():
    """A request with no match in its own text drafts the most frequent follower, in finished
    requests' outputs, of its longest context."""
    drafter = SuffixDrafter()
    for i, output in enumerate(([1, 2, 3, 4], [9, 1, 2, 3, 5], [7, 1, 2, 3, 4, 6])):
        done = sequence(f"old{i}", [100 + i])
        done.tokens = [100 + i, *output]
        drafter.finished(done)
    seq = sequence("new", [50, 51, 1, 2])
    draft = drafter.propose(seq, 3)
    # After (1, 2): 3 each time; after (1, 2, 3): 4 twice, 5 once; after (1, 2, 3, 4): 6 once.
    assert draft.tokens == [3, 4, 6]
    assert draft.keys == [support("shared", 2), support("shared", 3), support("shared", 4)]


def test_expected_tokens_are_the_mean_over_a_drafts_outcomes():
    acceptance = Acceptance()
    keys = [support("own", m) for m in (2, 3, 4, 6, 8)]
    # Records that set the keys' chances apart: tokens behind longer matches kept more often.
    for kept in (5, 5, 4, 2, 5, 1, 0, 5, 3):
        acceptance.record(keys, kept)
    p = [acceptance.chance(key) for key in keys]
    assert len(set(p)) > 2
    for d in range(len(keys) + 1):
        # Kept exactly a tokens: the first a kept, then (if a < d) the next refused.
        mean = sum(
            (a + 1) * np.prod(p[:a]) * (1 - p[a] if a < d else 1.0) for a in range(d + 1)
        )
        assert acceptance.expected_tokens(keys[:d]) == pytest.approx(mean, rel=1e-12)


def test_a_token_is_a_trial_only_when_every_token_before_it_was_kept():
    acceptance = Acceptance(prior=0.5, weight=2.0, decay=0.9)
    a, b, c = support("own", 2), support("own", 4), support("shared", 3)
    acceptance.record([a, b, c], 1)  # a kept, b refused, c never reached
    acceptance.record([a, b, c], 3)
    trials_a, kept_a = (2 * 0.9 + 1) * 0.9 + 1, (1 * 0.9 + 1) * 0.9 + 1
    trials_b, kept_b = (2 * 0.9 + 1) * 0.9 + 1, (1 * 0.9 + 0) * 0.9 + 1
    trials_c, kept_c = 2 * 0.9 + 1, 1 * 0.9 + 1
    assert acceptance.chance(a) == pytest.approx(kept_a / trials_a)
    assert acceptance.chance(b) == pytest.approx(kept_b / trials_b)
    assert acceptance.chance(c) == pytest.approx(kept_c / trials_c)
    assert acceptance.chance(support("own", 64)) == 0.5


class Programs:
    def __init__(self, tokens):
        self.tokens = tokens

    def verify_options(self, rows):
        return [(rows, t) for t in self.tokens]

    def decode_shape(self, rows):
        return rows


class Fixed:
    """Proposes given drafts (by request id) with given support keys."""

    name = "fixed"

    def __init__(self, drafts):
        self.drafts = drafts

    def propose(self, seq, k):
        tokens, keys = self.drafts[seq.request_id]
        return Draft(tokens[:k], keys[:k])

    def observe(self, seq, proposed, accepted):
        pass

    def finished(self, seq):
        pass


def test_the_plan_runs_the_program_expected_to_emit_most_tokens_a_second():
    """Two rows with drafts of different support; for measured step times that favour each
    choice in turn, the plan equals a brute force over decoding and every verify program."""
    keys_long = [support("own", 16 + j) for j in range(16)]
    keys_short = [support("own", 2 + j) for j in range(16)]
    drafts = {"a": (list(range(16)), keys_long), "b": (list(range(16)), keys_short)}
    speculator = Speculator(Fixed(drafts), 16, 4, [], 10_000)
    for kept, keys in ((16, keys_long), (16, keys_long), (2, keys_short), (0, keys_short), (16, keys_long)):
        speculator.acceptance.record(keys, kept)
    seqs = [sequence("a", [1, 2, 3]), sequence("b", [4, 5, 6])]
    programs = Programs([2, 5, 9, 17])
    seen = set()
    for decode, per_token in itertools.product((0.020, 0.030, 0.060), (0.0005, 0.002, 0.004, 0.02)):
        seconds = {("decode", 2): decode, **{("verify", 2, t): decode + per_token * (t - 1) for t in programs.tokens}}
        rates = {None: 2 / decode}
        for t in programs.tokens:
            expected = sum(speculator.acceptance.expected_tokens(keys[: t - 1]) for _, keys in drafts.values())
            rates[t] = expected / seconds[("verify", 2, t)]
        want = max(rates, key=lambda t: rates[t])
        plan = speculator.plan(seqs, programs, seconds)
        assert (plan.shape[1] if plan is not None else None) == want
        if plan is not None:
            assert [len(d) for d in plan.drafts.values()] == [want - 1, want - 1]
        seen.add(want)
    assert len(seen) >= 3  # the cases chose decoding and several programs
