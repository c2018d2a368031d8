"""On-device sampling against an independent numpy reference of HF's warpers.

The reference applies temperature, then top-k, then top-p (HF's order and semantics: top-p
keeps the smallest set of most likely tokens whose mass reaches p, always at least one) and
returns the renormalised distribution. Each case draws N tokens from `sample` (one row per
draw, the rows differing in step or seed) and checks that every draw is allowed and that
each token's count lies within 5 binomial standard deviations of N * p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.errors import JfireError
from jfire.sampling import SamplingParams, init_penalty_state, neutral_rows, sample

V = 32  # vocabulary size of the test logits
N = 4000  # draws per distribution
SIGMAS = 5.0



@jax.jit
def sample_jit(logits, seeds, steps, temperature, top_k, top_p):
    """Ids only, with penalties, masks and logprobs off (tested in test_sampling_extras.py)."""
    n, v = logits.shape
    rows = neutral_rows(n, v)._replace(seeds=seeds, temperature=temperature, top_k=top_k, top_p=top_p)
    return sample(logits, steps, rows, init_penalty_state(1, v))[0].ids


def reference_probs(logits, temperature, top_k, top_p) -> np.ndarray:
    """The distribution [v] HF samples from: temperature -> top-k -> top-p, renormalised."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones(len(z), bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    # Walk down the ranking; a token is kept while the mass of the tokens above it is short of p.
    mass_above = 0.0
    for rank, token in enumerate(order):
        if rank > 0 and mass_above >= top_p:
            keep[token] = False
        mass_above += p[token]
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def top_p_margin(logits, temperature, top_k, top_p) -> float:
    """How far the cumulative masses of the filtered ranking are from p: a case is only
    well posed (float32 on the device vs float64 here agree on the cut) if this is not tiny."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z)
    p = np.exp(z[order] - z.max())
    if top_k > 0:
        p[top_k:] = 0
    cum = np.cumsum(p / p.sum())
    return float(np.min(np.abs(cum - top_p)))


def draw(logits, seeds, steps, temperature, top_k, top_p) -> np.ndarray:
    """One token per row; scalar settings are broadcast over the rows of `seeds`/`steps`."""
    n = len(seeds)
    logits = np.broadcast_to(np.asarray(logits, np.float32), (n, np.shape(logits)[-1]))
    return np.asarray(sample_jit(
        jnp.asarray(logits),
        jnp.asarray(seeds, jnp.uint32),
        jnp.asarray(steps, jnp.uint32),
        jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (n,)),
        jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (n,)),
        jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (n,)),
    ))


def binomial_violations(counts, probs, n) -> list[tuple[int, int, float]]:
    """Tokens whose count is further than SIGMAS binomial standard deviations from n * p.

    With ~32 tokens per case and a handful of cases, a correct sampler trips a 5-sigma bound
    with probability well under 1e-3 in all; and the draws are seeded, so a pass is stable.
    """
    expected = n * probs
    sigma = np.sqrt(n * probs * (1 - probs))
    bad = np.abs(counts - expected) > SIGMAS * sigma + 1e-9
    return [(int(t), int(counts[t]), float(expected[t])) for t in np.flatnonzero(bad)]


def check_distribution(tokens, probs):
    tokens = np.asarray(tokens)
    assert tokens.min() >= 0 and tokens.max() < len(probs)
    disallowed = sorted(set(tokens[probs[tokens] == 0].tolist()))
    assert not disallowed, f"drew tokens outside the allowed set: {disallowed}"
    counts = np.bincount(tokens, minlength=len(probs))
    assert not binomial_violations(counts, probs, len(tokens)), \
        f"(token, count, expected) beyond {SIGMAS} sigma: {binomial_violations(counts, probs, len(tokens))}"
    return counts


@pytest.fixture(scope="module")
def logits():
    # Spread wide enough that temperature, top-k and top-p all change the distribution a lot.
    return np.random.RandomState(0).normal(0.0, 1.5, size=V).astype(np.float32)


# (temperature, top_k, top_p): each row a distinct way the filters combine.
CASES = {
    "plain": (1.0, 0, 1.0),
    "cool": (0.6, 0, 1.0),
    "hot": (1.7, 0, 1.0),
    "top_k": (1.0, 5, 1.0),
    "top_k_above_vocab": (1.0, V + 10, 1.0),
    "top_p": (1.0, 0, 0.7),
    "top_k_then_top_p": (0.8, 8, 0.6),
    "top_p_tiny_keeps_one": (1.0, 0, 1e-4),
    "top_k_one": (1.3, 1, 1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_draws_follow_reference_distribution(case, logits):
    temperature, top_k, top_p = CASES[case]
    if top_p < 1:
        assert top_p_margin(logits, temperature, top_k, top_p) > 1e-3, "ill-posed case: mass too close to p"
    probs = reference_probs(logits, temperature, top_k, top_p)
    tokens = draw(logits, np.full(N, 1234), np.arange(N), temperature, top_k, top_p)
    check_distribution(tokens, probs)


def test_reference_matches_transformers_warpers(logits):
    """The numpy reference keeps exactly the tokens HF's own warpers keep (so it is HF's semantics)."""
    import torch
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    for case, (temperature, top_k, top_p) in sorted(CASES.items()):
        scores = torch.tensor(logits, dtype=torch.float64)[None]
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        hf_probs = torch.softmax(scores, -1)[0].numpy()
        ours = reference_probs(logits, temperature, top_k, top_p)
        np.testing.assert_array_equal(hf_probs > 0, ours > 0, err_msg=case)
        np.testing.assert_allclose(ours, hf_probs, rtol=1e-12, atol=1e-15, err_msg=case)


def test_bound_rejects_a_wrong_temperature(logits):
    """The frequency check has teeth: the draws at T=0.6 fail against the T=1 distribution."""
    tokens = draw(logits, np.full(N, 99), np.arange(N), 0.6, 0, 1.0)
    counts = check_distribution(tokens, reference_probs(logits, 0.6, 0, 1.0))
    assert binomial_violations(counts, reference_probs(logits, 1.0, 0, 1.0), N)
    assert binomial_violations(counts, reference_probs(logits, 0.5, 0, 1.0), N)


def test_top_p_applies_after_top_k_renormalisation(logits):
    """top-p on the top-k-renormalised mass keeps fewer tokens than top-p on the full mass; the
    case above must tell the two apart, or it would not check the order."""
    temperature, top_k, top_p = CASES["top_k_then_top_p"]
    after = reference_probs(logits, temperature, top_k, top_p) > 0
    z = logits / temperature
    full = reference_probs(logits, temperature, 0, top_p) > 0
    top_k_set = np.zeros(V, bool)
    top_k_set[np.argsort(-z)[:top_k]] = True
    assert (after != (full & top_k_set)).any()
    tokens = draw(logits, np.full(N, 5), np.arange(N), temperature, top_k, top_p)
    assert set(np.unique(tokens)) == set(np.flatnonzero(after))


def test_draws_across_seeds_follow_reference(logits):
    """Randomness comes from the seed as well as the step: N seeds at one step."""
    probs = reference_probs(logits, 1.0, 0, 0.9)
    tokens = draw(logits, np.arange(N) * 7919 + 3, np.full(N, 17), 1.0, 0, 0.9)
    check_distribution(tokens, probs)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.5), (4, 0.3)])
def test_temperature_zero_is_argmax(logits, top_k, top_p):
    rng = np.random.RandomState(1)
    batch = rng.normal(0, 1.5, size=(64, V)).astype(np.float32)
    tokens = np.asarray(sample_jit(
        jnp.asarray(batch), jnp.arange(64, dtype=jnp.uint32), jnp.arange(64, dtype=jnp.uint32),
        jnp.zeros(64, jnp.float32), jnp.full(64, top_k, jnp.int32), jnp.full(64, top_p, jnp.float32)))
    np.testing.assert_array_equal(tokens, np.argmax(batch, axis=-1))


def test_same_seed_and_step_same_token_different_seeds_differ(logits):
    steps = np.arange(256)
    a = draw(logits, np.full(256, 42), steps, 1.0, 0, 1.0)
    again = draw(logits, np.full(256, 42), steps, 1.0, 0, 1.0)
    np.testing.assert_array_equal(a, again)
    # The same (seed, step) in other rows of a differently composed batch: still the same token.
    mixed_seeds = np.where(steps % 2 == 0, 42, 7)
    b = draw(logits, mixed_seeds, steps, 1.0, 0, 1.0)
    np.testing.assert_array_equal(b[::2], a[::2])
    # A flat-ish distribution over 32 tokens: two seeds agreeing on 256 draws would be absurd.
    c = draw(logits, np.full(256, 43), steps, 1.0, 0, 1.0)
    assert (a != c).mean() > 0.5
    assert (b[1::2] != a[1::2]).mean() > 0.5
    # Different steps of one seed differ too (the step is folded into the key).
    assert len(np.unique(a)) > 10
    # Extreme seeds and steps are valid uint32 values, and draw from the same distribution.
    probs = reference_probs(logits, 1.0, 0, 1.0)
    for seed in (0, 2**32 - 1):
        check_distribution(draw(logits, np.full(N, seed), 2**32 - 1 - np.arange(N), 1.0, 0, 1.0), probs)


def test_mixed_batch_rows_get_what_they_get_alone():
    """A greedy row, a top-k row and a top-p row share one batch (and one compiled program);
    each row must draw exactly the tokens it draws alone, and from its own distribution."""
    rng = np.random.RandomState(3)
    row_logits = rng.normal(0, 1.5, size=(3, V)).astype(np.float32)
    settings = [(0.0, 0, 1.0), (1.0, 4, 1.0), (0.9, 0, 0.75)]  # greedy, top-k, top-p
    for (t, k, p), lg in zip(settings, row_logits):
        if p < 1:
            assert top_p_margin(lg, t, k, p) > 1e-3
    n = 1500
    seeds = np.array([11, 22, 33])
    # Row r of step s sits at index 3 * s + r.
    mixed = draw(
        np.tile(row_logits, (n, 1)),
        np.tile(seeds, n), np.repeat(np.arange(n), 3),
        np.tile([s[0] for s in settings], n), np.tile([s[1] for s in settings], n),
        np.tile([s[2] for s in settings], n),
    ).reshape(n, 3)
    for r, (t, k, p) in enumerate(settings):
        alone = draw(row_logits[r], np.full(n, seeds[r]), np.arange(n), t, k, p)
        np.testing.assert_array_equal(mixed[:, r], alone, err_msg=f"row {r}")
        check_distribution(mixed[:, r], reference_probs(row_logits[r], t, k, p))
    # Truly alone: a batch of one, for a few steps.
    for r, (t, k, p) in enumerate(settings):
        for s in (0, 1, n - 1):
            one = draw(row_logits[r][None], [seeds[r]], [s], t, k, p)
            assert int(one[0]) == int(mixed[s, r]), (r, s)


# -- SamplingParams validation -------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(stop=("",)), "stop"),
    (dict(stop=("ok", "")), "stop"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**32), "seed"),
])
def test_sampling_params_rejects_bad_values(kwargs, field):
    with pytest.raises(JfireError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert field in message, message
    assert "\n" not in message


def test_sampling_params_reports_every_bad_field_at_once():
    with pytest.raises(JfireError) as info:
        SamplingParams(temperature=-1, top_p=2, top_k=-2, max_tokens=0)
    for field in ("temperature", "top_p", "top_k", "max_tokens"):
        assert field in str(info.value)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(temperature=0.0),
    dict(top_p=1.0, top_k=0),
    dict(top_p=1e-6, top_k=1),
    dict(max_tokens=1, seed=0),
    dict(seed=2**32 - 1, stop=("\n",)),
])
def test_sampling_params_accepts_boundary_values(kwargs):
    params = SamplingParams(**kwargs)
    assert 0 <= params.resolved_seed() < 2**32
    if "seed" in kwargs:
        assert params.resolved_seed() == kwargs["seed"]


def test_greedy_ids_is_argmax_with_ties_infinities_and_nans():
    """The engine's greedy pick equals numpy's argmax: the first maximum, the first NaN."""
    from jfire.sampling import greedy_ids

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((9, 1000)).astype(np.float32)
    logits[1, [7, 500]] = 50.0  # a tie: the first wins
    logits[2] = -np.inf  # every token masked
    logits[3, [20, 900]] = np.nan
    logits[4, -1] = np.inf
    logits[5, :] = 1.0
    logits[6, 0] = np.nan
    got = np.asarray(jax.jit(greedy_ids)(logits))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
