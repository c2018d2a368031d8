"""Drafts from a draft model run inside the target's own programs: DeepSeek-V3's MTP layer
(jfire.models.mtp) and EAGLE-3 heads (jfire.models.eagle3).

Both draft the same way: the draft row at position p holds the target's hidden state at p
(MTP: its last, after the final norm; EAGLE-3: `fuse` of three of its intermediate residual
streams, captured as the decoder runs, `jfire.models.family.capture_hidden`) and the token at
p + 1, and predicts the token at p + 2. A draft model needs the target's hidden state at every
position the target confirms, so it runs in the same compiled program, right after the
target's layers and its sampling, and the program hands back the next step's draft with the
sampled ids. Each prefill, decode and verify program then does two things more:

- catch-up: the draft layer's cache entry for every position the step computed, the pair
  (h[p], x[p + 1]) written at position p. x[p + 1] is the next prompt token (the host passes
  it), or, at a row's last position, the token the step sampled there; in a verify step it is
  the token each position sampled, which equals the next draft wherever the row kept it.
  Entries past a verify row's emitted tokens are left behind and written again before any
  query reads them: a query at position q reads entries up to q, and every entry below the
  row's length was written by its catch-up, every one from the length up by this step's chain.
- chain: from the row's last confirmed position, the draft's greedy token, then k - 1 more
  steps of one token each, each feeding back the draft layer's own output hidden state and
  token, written at the next position. A chain position needs a page of the row's: positions
  from `room` (the row's pages' end) up are not written, and the draft ends before them (-1).

Drafts are greedy (a one-hot draft distribution): the verify program's coupled rejection
keeps the target's tokens exact at any temperature (jfire.speculative.verify).

The draft layer's cache is more arrays in the engine's pages (named apart from the target's),
indexed by the target's page tables, so it grows, shrinks and is freed with the target's
pages. Two things it does not follow: on a prefix-cache hit the entry at the last cached
position is the earlier request's (computed with its next token, which may differ), and a
disaggregated decode group does not receive the prompt's entries; both cost draft quality,
never tokens. Not on pipeline stages (pp > 1): EAGLE-3's capture runs inside the layer scan.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jfire.models import eagle3, mtp
from jfire.models.family import capture_hidden


class DraftIn(NamedTuple):
    """A program's per-row inputs for its draft model."""

    next_tokens: jax.Array  # int32 [b, t]: the token after each position (-1: the one sampled there)
    room: jax.Array  # int32 [b]: positions below this lie in the row's pages


class DraftModel:
    """A draft model as the programs run it (a static jit argument): where its parameters sit
    in the programs' params (`PARAMS`), which target hidden states it reads (`aux_indices`,
    captured; none: the decoder's output), and its one-token-a-row step."""

    PARAMS: str
    aux_indices: tuple[int, ...] = ()
    k: int

    def cache_arrays(self, num_pages: int, page_size: int, dtype) -> dict:
        raise NotImplementedError

    def kv_bytes_per_token(self, dtype) -> int:
        """Bytes its cache takes per token (the engine's pools are sized with them)."""
        raise NotImplementedError

    def target_hidden(self, params, hidden, captured: dict):
        """The first draft step's hidden input at each position, from the target's."""
        return hidden

    def step(self, params, hidden, tokens, positions, pages, page_table, attention_impl, parallel):
        """(greedy target ids [b, t], output hidden [b, t, H], pages) of one draft pass."""
        raise NotImplementedError

    def __call__(
        self, params, pages, hidden, draft_in: DraftIn, sampled, positions, last, page_table, attention_impl, parallel
    ):
        """The step's catch-up and chain: hidden [b, t, ...] (`target_hidden`'s) at positions
        [b, t]; sampled [b, t] or [b] the ids the step sampled; last [b] each row's last
        confirmed position's index in t. Returns (drafts [b, k], pages)."""
        b = hidden.shape[0]
        row = jnp.arange(b)
        if sampled.ndim == 1:  # prefill and decode: sampled at the row's last position
            sampled = jnp.zeros_like(draft_in.next_tokens).at[row, last].set(sampled)
        next_tokens = jnp.where(draft_in.next_tokens < 0, sampled, draft_in.next_tokens)
        run = dict(page_table=page_table, attention_impl=attention_impl, parallel=parallel)
        ids, out, pages = self.step(params, hidden, next_tokens, positions, pages, **run)
        start = positions[row, last]

        def chain(carry, _):
            h, token, position, pages, alive = carry
            position = position + 1
            alive = alive & (position < draft_in.room)
            at = jnp.where(alive, position, -1)[:, None]
            ids, out, pages = self.step(params, h[:, None], token[:, None], at, pages, **run)
            return (out[:, 0], ids[:, 0], position, pages, alive), jnp.where(alive, ids[:, 0], -1)

        alive = start >= 0
        first = ids[row, last]
        (_, _, _, pages, _), rest = jax.lax.scan(
            chain, (out[row, last], first, start, pages, alive), None, length=self.k - 1
        )
        drafts = jnp.concatenate([jnp.where(alive, first, -1)[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
        return drafts, pages


@dataclasses.dataclass(frozen=True)
class MtpDrafts(DraftModel):
    """DeepSeek-V3's MTP layer: drafts from the target's last hidden state."""

    cfg: mtp.MtpConfig
    k: int  # draft tokens a step

    PARAMS = "mtp"

    def cache_arrays(self, num_pages: int, page_size: int, dtype) -> dict:
        return mtp.init_cache(self.cfg, num_pages, page_size, dtype)

    def kv_bytes_per_token(self, dtype) -> int:
        return self.cfg.kv_bytes_per_token(dtype)

    def step(self, params, hidden, tokens, positions, pages, page_table, attention_impl, parallel):
        cache = {mtp.CACHE: pages[mtp.CACHE]}
        logits, out, cache = mtp.mtp_forward(
            self.cfg,
            params[self.PARAMS],
            params,
            hidden,
            tokens,
            positions,
            cache,
            page_table,
            attention_impl=attention_impl,
            parallel=parallel,
        )
        ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return ids, out, {**pages, mtp.CACHE: cache[mtp.CACHE]}


@dataclasses.dataclass(frozen=True)
class Eagle3Drafts(DraftModel):
    """An EAGLE-3 head: drafts from three of the target's intermediate hidden states, fused."""

    cfg: eagle3.Eagle3Config
    k: int
    aux_indices: tuple[int, ...]  # HF hidden_states indices, in the order `fuse` concatenates them

    PARAMS = "eagle3"
    PREFIX = "eagle3_"  # its cache arrays' names in the engine's pages (the target has a "k" too)

    def cache_arrays(self, num_pages: int, page_size: int, dtype) -> dict:
        return {self.PREFIX + n: a for n, a in eagle3.init_cache(self.cfg, num_pages, page_size, dtype).items()}

    def kv_bytes_per_token(self, dtype) -> int:
        import numpy as np

        return sum(int(np.prod(s.shape(1, 1))) for s in self.cfg.cache_specs()) * jnp.dtype(dtype).itemsize

    def target_hidden(self, params, hidden, captured: dict):
        aux = jnp.concatenate([captured[i] for i in self.aux_indices], axis=-1)
        return eagle3.fuse(self.cfg, params[self.PARAMS], aux)

    def step(self, params, hidden, tokens, positions, pages, page_table, attention_impl, parallel):
        head = params[self.PARAMS]
        names = [s.name for s in self.cfg.cache_specs()]
        cache = {n: pages[self.PREFIX + n] for n in names}
        embed = eagle3.draft_embedding(head, params["embed"])
        logits, out, cache = eagle3.draft_forward(
            self.cfg, head, embed, hidden, tokens, positions, cache, page_table, attention_impl=attention_impl
        )
        ids = eagle3.to_target_ids(head, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
        return ids, out, {**pages, **{self.PREFIX + n: cache[n] for n in names}}


def capturing(draft: DraftModel | None):
    """Around a program's target decoder: the intermediate hidden states `draft` reads, as a
    dict filled while the decoder is traced (nothing captured, and the decoder traced as
    without a draft, where none is needed)."""
    if draft is None or not draft.aux_indices:
        return contextlib.nullcontext({})
    return capture_hidden(draft.aux_indices)


def load_draft(model, config) -> tuple[DraftModel, dict]:
    """(the draft, its parameters) of an engine with settings `config` (`speculative` "mtp" or
    "eagle3", `draft_model` the head's directory) over the LoadedModel `model`."""
    from jfire.errors import JfireError

    if model.mesh is not None and model.mesh.shape.get("pp", 1) > 1:
        raise JfireError(
            f"--speculative {config.speculative} does not run on pipeline stages (pp > 1); use ngram or suffix"
        )
    if config.speculative == "mtp":
        mtp_cfg, mtp_params = mtp.load_mtp(model)
        return MtpDrafts(mtp_cfg, config.num_draft_tokens), mtp_params
    if not config.draft_model:
        raise JfireError("--speculative eagle3 needs the head's directory: --draft-model PATH")
    from jfire.checkpoint.eagle3_load import load_eagle3

    cfg, params = load_eagle3(config.draft_model, model.dtype if model.dtype in ("float32", "bfloat16") else "float32")
    target = model.config
    if cfg.target_hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
        raise JfireError(
            f"the EAGLE-3 head in {config.draft_model} drafts for a model of hidden size {cfg.target_hidden_size} "
            f"and vocabulary {cfg.vocab_size}, not this one's ({target.hidden_size}, {target.vocab_size})"
        )
    indices = cfg.target_hidden_indices(sum(seg.count for seg in target.segments()))
    if max(indices) >= sum(seg.count for seg in target.segments()):
        raise JfireError(
            f"the EAGLE-3 head reads the target's hidden state after its last layer ({max(indices)}): not supported"
        )
    return Eagle3Drafts(cfg, config.num_draft_tokens, indices), jax.device_put(params)
