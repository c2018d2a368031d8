"""The sampler's penalties, token masks and logprobs (jfire.sampling.sample) against numpy
implementations of their definitions, on random logits: OpenAI's frequency and presence
penalties, HF's repetition penalty, a bitmask of allowed tokens, log-softmax and its top-k,
and the device-side counts each call updates."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jfire.grammar import ban
from jfire.sampling import MAX_TOP_LOGPROBS, PenaltyState, init_penalty_state, neutral_rows, sample, set_penalty_slot

V = 300  # not a multiple of 32: the mask's last word is partial
B = 4
sample_jit = jax.jit(sample)


def numpy_penalized(logits, generated, in_prompt, frequency, presence, repetition):
    logits = logits.astype(np.float64) - generated * frequency - (generated > 0) * presence
    seen = (generated > 0) | in_prompt
    return np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)


def log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.fixture
def case():
    rng = np.random.RandomState(0)
    logits = rng.normal(0, 2, size=(B, V)).astype(np.float32)
    generated = rng.poisson(0.3, size=(B, V)).astype(np.int32)
    in_prompt = rng.rand(B, V) < 0.1
    return logits, generated, in_prompt


def state_with(generated, in_prompt) -> PenaltyState:
    """Slots 0..B-1 hold the rows' counts; slot B is the scratch slot."""
    state = init_penalty_state(B + 1, V)
    for r in range(B):
        state = set_penalty_slot(state, r, generated[r], in_prompt[r])
    return state


def test_penalties_follow_the_formulas_and_counts_grow_by_the_sampled_token(case):
    logits, generated, in_prompt = case
    frequency = np.array([0.0, 0.7, -0.5, 1.5], np.float32)
    presence = np.array([0.0, 0.3, 1.0, -1.2], np.float32)
    repetition = np.array([1.0, 1.0, 1.3, 0.8], np.float32)
    rows = neutral_rows(B, V)._replace(frequency=frequency, presence=presence, repetition=repetition,
                                       slot=np.arange(B, dtype=np.int32), logprobs=np.ones(B, bool))
    out, state = sample_jit(logits, np.zeros(B, np.uint32), rows, state_with(generated, in_prompt))
    for r in range(B):
        expected = numpy_penalized(logits[r], generated[r], in_prompt[r], frequency[r], presence[r], repetition[r])
        assert int(out.ids[r]) == int(np.argmax(expected))  # greedy on the penalized logits
        np.testing.assert_allclose(float(out.logprob[r]), log_softmax(expected)[int(out.ids[r])], atol=1e-5)
    grown = generated.copy()
    grown[np.arange(B), np.asarray(out.ids)] += 1
    np.testing.assert_array_equal(np.asarray(state.generated[:B]), grown)
    np.testing.assert_array_equal(np.asarray(state.in_prompt[:B]), in_prompt)


def test_rows_without_penalties_ignore_their_slot_and_write_the_scratch_slot(case):
    logits, generated, in_prompt = case
    rows = neutral_rows(B, V)._replace(slot=np.full(B, B, np.int32))
    mixed = rows._replace(frequency=np.array([0, 0, 0, 2.0], np.float32), slot=np.array([B, B, B, 3], np.int32))
    plain, _ = sample_jit(logits, np.zeros(B, np.uint32), rows, state_with(generated, in_prompt))
    out, state = sample_jit(logits, np.zeros(B, np.uint32), mixed, state_with(generated, in_prompt))
    np.testing.assert_array_equal(np.asarray(out.ids[:3]), np.argmax(logits[:3], axis=-1))
    np.testing.assert_array_equal(np.asarray(plain.ids), np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(np.asarray(state.generated[:3]), generated[:3])  # untouched


def test_the_mask_allows_exactly_its_tokens_and_logprobs_are_renormalized(case):
    logits, _, _ = case
    rng = np.random.RandomState(1)
    allowed_sets = [rng.choice(V, size=k, replace=False) for k in (1, 5, 40, V)]
    words = np.zeros((B, -(-V // 32)), np.int32)
    for r, allowed in enumerate(allowed_sets):
        for t in allowed:
            words[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    seeds = np.arange(B, dtype=np.uint32)
    for temperature in (0.0, 1.0):
        rows = neutral_rows(B, V)._replace(allowed=words, seeds=seeds, logprobs=np.ones(B, bool),
                                           temperature=np.full(B, temperature, np.float32))
        for step in range(20):
            out, _ = sample_jit(logits, np.full(B, step, np.uint32), rows, init_penalty_state(1, V))
            for r, allowed in enumerate(allowed_sets):
                assert int(out.ids[r]) in set(allowed.tolist())
    r = 2  # 40 allowed tokens: logprobs are over them alone, the rest -inf
    masked = np.full(V, -np.inf)
    masked[allowed_sets[r]] = logits[r, allowed_sets[r]]
    expected = log_softmax(masked)
    order = np.argsort(-expected, kind="stable")[:MAX_TOP_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(out.top_ids[r]), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs[r]), expected[order], atol=1e-5)


def test_ban_clears_only_the_given_tokens():
    words = np.full((2, -(-V // 32)), -1, np.int32)
    ban(words, 1, [0, 31, 32, 299])
    bits = ((words[:, :, None].view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1).reshape(2, -1)[:, :V]
    assert bits[0].all()
    assert set(np.flatnonzero(bits[1] == 0).tolist()) == {0, 31, 32, 299}


def test_rows_without_logprobs_get_zeros(case):
    logits, _, _ = case
    out, _ = sample_jit(logits, np.zeros(B, np.uint32), neutral_rows(B, V), init_penalty_state(1, V))
    assert not np.asarray(out.top_logprobs).any() and not np.asarray(out.logprob).any()
