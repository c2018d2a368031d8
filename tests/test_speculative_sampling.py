"""Speculative sampling keeps the target's distribution.

- The general rejection sampler (jfire.speculative.rejection: drafts drawn from a q of their
  own) against its law: over 200,000 draws on a 6-token vocabulary, with p and q fixed and far
  apart, the first emitted token, the token after an accepted first draft and the acceptance
  rate match p, p and sum(min(p, q)) by a chi-square test at p-value 1e-4 (and a 4-sigma
  bound on the rate).
- The engine's verify step (one-token drafts, acceptance coupled to the target's own draw) at
  temperature 1: 48 seeded requests with drafts taken from other seeds' answers (so most are
  refused at some point) emit, seed by seed, the tokens the same seeds emit without drafts.
  Equal draws for every seed make the two samples' distributions equal, which a two-sample
  test could only approximate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.sampling import SamplingParams
from jfire.speculative.rejection import rejection_sample
from tests.test_speculative import CONFIG, Oracle, Silent, run

DRAWS = 200_000
P = np.array([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04], [0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
              [0.30, 0.10, 0.10, 0.10, 0.10, 0.30]], np.float32)
Q = np.array([[0.05, 0.10, 0.15, 0.20, 0.20, 0.30], [0.50, 0.10, 0.10, 0.10, 0.10, 0.10]], np.float32)


def test_rejection_sampling_keeps_the_target_distribution():
    key = jax.random.key(0)
    draft_key, sample_key = jax.random.split(key)
    # Drafts drawn from q, position by position.
    drafts = jax.random.categorical(draft_key, jnp.log(jnp.asarray(Q))[None], shape=(DRAWS, 2)).astype(jnp.int32)
    target = jnp.broadcast_to(jnp.asarray(P), (DRAWS, 3, 6))
    draft_probs = jnp.broadcast_to(jnp.asarray(Q), (DRAWS, 2, 6))
    tokens, emitted = jax.jit(rejection_sample)(sample_key, target, draft_probs, drafts)
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)

    def check(sample, p):
        counts = np.bincount(sample, minlength=6)
        assert stats.chisquare(counts, p / p.sum() * len(sample)).pvalue > 1e-4, (counts, p)

    check(tokens[:, 0], P[0])  # the first token, kept draft or drawn: distributed as p
    second = emitted >= 2  # the first draft kept: the next token is distributed as p at position 2
    check(tokens[second, 1], P[1])
    rate = np.mean(second)
    expected = np.minimum(P[0], Q[0]).sum()
    assert abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / DRAWS), (rate, expected)
    both = emitted == 3  # both kept: the bonus token is distributed as p at position 3
    check(tokens[both, 2], P[2])


def test_sampled_tokens_with_drafts_equal_those_without_seed_by_seed(tiny_hf_dir):
    model = load_model(str(tiny_hf_dir("llama3")), "float32")
    prompt = [5, 17, 33, 9, 17, 33, 9, 41]
    requests = [(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True))
                for seed in range(48)]
    with Engine(model, EngineConfig(**CONFIG)) as engine:
        want = run(engine, Silent(), requests)
        # Each request drafts the answer of the seed after it: plausible tokens, often refused.
        answers = {(tuple(p), sp): want[(i + 1) % len(requests)].token_ids for i, (p, sp) in enumerate(requests)}
        got = run(engine, Oracle(answers, wrong=0), requests)
        stats_now = engine.stats()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert 0 < stats_now["spec_accepted_tokens"] < stats_now["spec_draft_tokens"]
