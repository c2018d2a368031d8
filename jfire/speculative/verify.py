"""The verify program: a decode step of k + 1 tokens a row, each position computed and sampled
as decoding would, the row keeping its drafts up to the first the model would not have made.

A row's tokens are its last sampled token and its drafts d1..dk, at positions p .. p + k.
Every layer writes all k + 1 entries into the row's pages, then attends each position as a
decode row of its own (`jfire.models.blocks.DecodeRows`); the products run on all rows at
once through the CPU kernels, whose sums per row do not depend on the rows beside it; the
head gives each position the logits decode's head gives (`cpu_matmul.decode_rows`). Position
j then samples with decode's own rule and random key (seed, p + j), under its own token mask
and with the penalty counts of the tokens before it. The row emits the sampled tokens while
each equals the draft after it, and then the first that does not:

  emitted = [s0, s1, ..., sa] where s_j = d_{j+1} for j < a, and a = k or s_a != d_{a+1}.

Those are exactly the tokens decoding one at a time would have produced, greedy or sampled
(with a one-token draft distribution this is rejection sampling with the acceptance draw
coupled to the target's own: a draft x is kept with probability p(x), and a rejection draws
from p without x, which is max(p - q, 0) normalised; jfire.speculative.rejection has the
general rule for drafts with a distribution). Entries past the emitted ones are left in the
pages: nothing reads them before the positions are written again, and generated tokens are
never hashed into the prefix cache.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jfire.attention import decode_attention
from jfire.kernels import cpu_matmul as cpu_matmul_kernels
from jfire.models.blocks import DecodeRows
from jfire.models.family import Family
from jfire.sampling import PenaltyState, RowSampling, sample
from jfire.speculative.model_drafts import capturing


class VerifyOut(NamedTuple):
    ids: jax.Array  # int32 [b, t]: what each position sampled
    logprob: jax.Array  # float32 [b, t]
    top_ids: jax.Array  # int32 [b, t, MAX_TOP_LOGPROBS]
    top_logprobs: jax.Array  # float32 [b, t, MAX_TOP_LOGPROBS]
    emitted: jax.Array  # int32 [b]: the row's tokens are ids[:emitted]
    drafts: jax.Array | None = None  # int32 [b, k]: a draft model's next drafts (-1: none), where one runs


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "attention", "layer_stack", "parallel", "cpu_matmul", "draft"),
    donate_argnames=("pages", "penalties"),
)
def verify(
    params,
    pages,
    tokens,
    positions,
    page_table,
    num_drafts,
    rows: RowSampling,
    penalties: PenaltyState,
    extras=None,
    *,
    cfg: Family,
    attention: str = "reference",
    layer_stack=None,
    parallel=None,
    cpu_matmul: bool = False,
    draft=None,
):
    """tokens/positions [b, t] (position -1: past the row's drafts, or an empty row), page_table
    [b, groups x w], num_drafts [b]; rows.allowed is [b, t, words], each position's mask.
    Returns (VerifyOut, penalties, pages). `draft`: a draft model run after the step over the
    emitted tokens (jfire.speculative.model_drafts), its inputs `extras.draft`."""
    draft_in = extras.draft if extras is not None else None
    b, t = tokens.shape
    with cpu_matmul_kernels.in_place(cpu_matmul), capturing(draft) as captured:
        hidden, pages = cfg.decoder(
            params,
            tokens,
            positions,
            pages,
            page_table,
            attention_impl=DecodeRows(decode_attention(attention)),
            layer_stack=layer_stack,
            parallel=parallel,
        )
        with cpu_matmul_kernels.decode_rows(b):
            logits = cfg.logits(params, jnp.swapaxes(hidden, 0, 1))  # [t, b, v]
    scratch = penalties.generated.shape[0] - 1
    # On a mesh the penalty counts stay replicated, as every program takes and returns them (the
    # loop's carry would otherwise take the sharding of the vocabulary-split logits).
    mesh = getattr(parallel, "mesh", None) or getattr(layer_stack, "mesh", None)

    def replicated(state):
        if mesh is None:
            return state
        return jax.lax.with_sharding_constraint(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    following = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)

    def position(carry, j):
        penalties, alive = carry
        # A row past its first miss samples into the scratch slot: its counts stay those of its
        # emitted tokens.
        row = rows._replace(allowed=rows.allowed[:, j], slot=jnp.where(alive, rows.slot, scratch))
        out, penalties = sample(logits[j], positions[:, j].astype(jnp.uint32), row, penalties)
        penalties = replicated(penalties)
        kept = alive & (j < num_drafts) & (out.ids == following[:, j])
        return (penalties, kept), (out.ids, out.logprob, out.top_ids, out.top_logprobs, alive)

    (penalties, _), (ids, logprob, top_ids, top_lps, alive) = jax.lax.scan(
        position, (replicated(penalties), positions[:, 0] >= 0), jnp.arange(t)
    )
    out = VerifyOut(
        jnp.swapaxes(ids, 0, 1),
        jnp.swapaxes(logprob, 0, 1),
        jnp.swapaxes(top_ids, 0, 1),
        jnp.swapaxes(top_lps, 0, 1),
        alive.sum(axis=0).astype(jnp.int32),
    )
    if draft is not None:
        # Every position's own sample is the token after it wherever the row kept its drafts.
        last = jnp.maximum(out.emitted - 1, 0)
        drafts, pages = draft(
            params,
            pages,
            draft.target_hidden(params, hidden, captured),
            draft_in,
            out.ids,
            positions,
            last,
            page_table,
            decode_attention(attention),
            parallel,
        )
        out = out._replace(drafts=drafts)
    return out, replicated(penalties), pages
