"""The compiled programs: prefill and decode, each a pure function jitted on its own.

Prefill is compute-bound (a chunk of prompt tokens in one pass); decode is memory-bound
(one token per sequence, reading the whole cache). Both write the cache they are given,
which is donated so XLA updates it in place, and both sample on the device so only the
new ids cross back to the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jfire.models.llama import LlamaConfig, decoder, logits_from_hidden
from jfire.sampling import sample


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill(params, cache, tokens, positions, last_index, seeds, temperature, top_k, top_p, *, cfg: LlamaConfig):
    """tokens/positions [b, t] (position -1 = padding); last_index [b] picks each row's last
    real token. Returns (next ids [b], their logits [b, v], cache)."""
    hidden, cache = decoder(params, cfg, tokens, positions, cache)
    rows = jnp.arange(tokens.shape[0])
    logits = logits_from_hidden(params, cfg, hidden[rows, last_index])
    steps = positions[rows, last_index].astype(jnp.uint32)
    return sample(logits, seeds, steps, temperature, top_k, top_p), logits, cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode(params, cache, tokens, positions, seeds, temperature, top_k, top_p, *, cfg: LlamaConfig):
    """One token per row: tokens/positions [b]. Returns (next ids [b], logits [b, v], cache)."""
    hidden, cache = decoder(params, cfg, tokens[:, None], positions[:, None], cache)
    logits = logits_from_hidden(params, cfg, hidden[:, 0])
    return sample(logits, seeds, positions.astype(jnp.uint32), temperature, top_k, top_p), logits, cache
