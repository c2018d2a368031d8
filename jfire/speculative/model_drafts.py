"""Drafts from a draft model run inside the target's own programs: DeepSeek-V3's MTP layer.

A model drafter needs the target's hidden state at every position the target confirms, so it
runs in the same compiled program, right after the target's layers and its sampling, and the
program hands back the next step's draft with the sampled ids. Each prefill, decode and
verify program then does two things more:

- catch-up: the draft layer's cache entry for every position the step computed, the pair
  (h[p], x[p + 1]) written at position p (jfire.models.mtp). x[p + 1] is the next prompt token
  (the host passes it), or, at a row's last position, the token the step sampled there; in a
  verify step it is the token each position sampled, which equals the next draft wherever
  the row kept it. Entries past a verify row's emitted tokens are left behind and written
  again before any query reads them: a query at position q reads entries up to q, and every
  entry below the row's length was written by its catch-up, every one from the length up by
  this step's chain.
- chain: from the row's last confirmed position, the draft's greedy token, then k - 1 more
  steps of one token each, each feeding back the draft layer's own output hidden state and
  token, written at the next position. A chain position needs a page of the row's: positions
  from `room` (the row's pages' end) up are not written, and the draft ends before them (-1).

Drafts are greedy (a one-hot draft distribution): the verify program's coupled rejection
keeps the target's tokens exact at any temperature (jfire.speculative.verify).

The draft layer's cache is one more array in the engine's pages (`mtp_latent`), indexed by
the target's page tables, so it grows, shrinks and is freed with the target's pages. Two
things it does not follow: on a prefix-cache hit the entry at the last cached position is
the earlier request's (computed with its next token, which may differ), and a disaggregated
decode group does not receive the prompt's entries; both cost draft quality, never tokens.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jfire.models import mtp


class DraftIn(NamedTuple):
    """A program's per-row inputs for its draft model."""

    next_tokens: jax.Array  # int32 [b, t]: the token after each position (-1: the one sampled there)
    room: jax.Array  # int32 [b]: positions below this lie in the row's pages


@dataclasses.dataclass(frozen=True)
class MtpDrafts:
    """DeepSeek-V3's MTP layer as the draft model of an engine: static (a jit argument)."""

    cfg: mtp.MtpConfig
    k: int  # draft tokens a step

    PARAMS = "mtp"  # the draft layer's parameters, beside the target's in the programs' params

    def cache_specs(self):
        return self.cfg.cache_specs()

    def __call__(
        self, params, pages, hidden, draft_in: DraftIn, sampled, positions, last, page_table, attention_impl, parallel
    ):
        """The step's catch-up and chain: hidden [b, t, e] (the target's, after its final norm)
        at positions [b, t]; sampled [b, t] or [b] the ids the step sampled; last [b] each
        row's last confirmed position's index in t. Returns (drafts [b, k], pages)."""
        b = hidden.shape[0]
        row = jnp.arange(b)
        if sampled.ndim == 1:  # prefill and decode: sampled at the row's last position
            sampled = jnp.zeros_like(draft_in.next_tokens).at[row, last].set(sampled)
        next_tokens = jnp.where(draft_in.next_tokens < 0, sampled, draft_in.next_tokens)
        run = dict(attention_impl=attention_impl, parallel=parallel)
        cache = {mtp.CACHE: pages[mtp.CACHE]}
        logits, out, cache = mtp.mtp_forward(
            self.cfg, params[self.PARAMS], params, hidden, next_tokens, positions, cache, page_table, **run
        )
        start = positions[row, last]
        first = jnp.argmax(logits[row, last], axis=-1).astype(jnp.int32)

        def chain(carry, _):
            h, token, position, cache, alive = carry
            position = position + 1
            alive = alive & (position < draft_in.room)
            logits, out, cache = mtp.mtp_forward(
                self.cfg,
                params[self.PARAMS],
                params,
                h[:, None],
                token[:, None],
                jnp.where(alive, position, -1)[:, None],
                cache,
                page_table,
                **run,
            )
            token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return (out[:, 0], token, position, cache, alive), jnp.where(alive, token, -1)

        alive = start >= 0
        carry = (out[row, last], first, start, cache, alive)
        (_, _, _, cache, _), rest = jax.lax.scan(chain, carry, None, length=self.k - 1)
        drafts = jnp.concatenate([jnp.where(alive, first, -1)[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
        return drafts, {**pages, mtp.CACHE: cache[mtp.CACHE]}


def load_draft(model, name: str, k: int) -> tuple[MtpDrafts, dict]:
    """(the draft, its parameters) of `--speculative name` over the LoadedModel `model`."""
    cfg, params = mtp.load_mtp(model)
    return MtpDrafts(cfg, k), params
