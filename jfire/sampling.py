"""Sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Every row of a batch carries its own parameters, so requests with different settings share
one compiled program. A row's random key is `fold_in(key(seed), step)`: the same request
draws the same tokens whether it runs alone or batched with others.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jfire.errors import JfireError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # None: a fresh random seed per request
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        problems = []
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            problems.append(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        # top_k travels to the device as an int32: a larger value would overflow on the engine thread.
        if not 0 <= self.top_k <= 2**31 - 1:
            problems.append(f"top_k must be in [0, 2**31 - 1] (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**32):
            problems.append(f"seed must be in [0, 2**32), got {self.seed}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise JfireError("; ".join(problems))

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else int.from_bytes(os.urandom(4), "little")


def sample(logits, seeds, steps, temperature, top_k, top_p):
    """Next ids [b] from logits [b, v] (float32); seeds/steps uint32 [b]; per-row settings [b]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic():
        return jax.vmap(_sample_row)(logits, seeds, steps, temperature, top_k, top_p)

    sampled = jax.lax.cond(jnp.all(temperature <= 0), lambda: greedy, stochastic)
    return jnp.where(temperature <= 0, greedy, sampled)


def _sample_row(logits, seed, step, temperature, top_k, top_p):
    key = jax.random.fold_in(jax.random.key(seed), step)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)  # descending; ties keep the lower id first
    ranked = scaled[order]
    rank = jnp.arange(ranked.shape[0])
    keep = jnp.where(top_k > 0, rank < top_k, True)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf))
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is short.
    keep &= (jnp.cumsum(probs) - probs) < top_p
    choice = jax.random.categorical(key, jnp.where(keep, ranked, -jnp.inf))
    return order[choice].astype(jnp.int32)
