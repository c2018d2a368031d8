"""Rejection sampling of drafts that carry a distribution of their own (Leviathan et al. 2023;
Chen et al. 2023): the tokens kept are distributed exactly as the target model's.

For a draft token x drawn from the drafter's q, keep x with probability min(1, p(x) / q(x));
on the first rejection draw the position's token from the residual max(p - q, 0),
normalised, and stop; if every draft is kept, draw one more token from the target's next
distribution. Each kept or drawn token is then distributed as p, whatever q is.

The engine's verify step (jfire.speculative.verify) meets drafts that are single tokens: the
model-free drafters', and a draft model's greedy ones. Their q is one-hot, so the rule reads
"keep x with probability p(x), else draw from p without x", which is what the verify step
does with the acceptance coupled to the target's own draw: it samples the position as
decoding would, with decoding's random key, and keeps x if that sample is x. Same law, and
the same tokens as decoding without drafts, seed for seed. This module is the general rule,
for drafters that sample their drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rejection_sample(key, target_probs, draft_probs, drafts):
    """target_probs [b, k + 1, v] (the target's distribution at each draft position and after
    the last), draft_probs [b, k, v] (q of each draft), drafts [b, k] int32 (drawn from q).
    Returns (tokens [b, k + 1], emitted [b]): the row's tokens are tokens[:emitted], the kept
    drafts then one drawn token."""
    b, k = drafts.shape
    accept_key, residual_key, bonus_key = jax.random.split(key, 3)
    p_draft = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(accept_key, (b, k))
    # u < p / q, written without the division (q(x) > 0 for a drawn x).
    kept = u * q_draft < p_draft
    accepted = jnp.cumprod(kept, axis=1).sum(axis=1)  # leading drafts kept
    residual = jnp.maximum(target_probs[:, :k] - draft_probs, 0.0)
    # Where p <= q everywhere the residual is empty; rejection then has probability 0.
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, target_probs[:, :k])
    fixes = jax.random.categorical(residual_key, jnp.log(residual), axis=-1)  # [b, k]
    bonus = jax.random.categorical(bonus_key, jnp.log(target_probs[:, k]), axis=-1)  # [b]
    drawn = jnp.concatenate([fixes, bonus[:, None]], axis=1)  # the token drawn at each position
    position = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    tokens = jnp.where(position < accepted[:, None], padded, drawn).astype(jnp.int32)
    return tokens, (accepted + 1).astype(jnp.int32)
