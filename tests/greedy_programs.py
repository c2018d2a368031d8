"""The compiled programs called directly, greedy, for tests that check them against a
reference: neutral sampling rows (no penalties, masks or logprobs) and a fresh penalty state,
returning (next ids, logits, pages) as the engine reads them.

They are the engine's prefill and decode functions jitted with the quick compile's options
(programs.QUICK_COMPILE): the tests' tiny models spend far longer compiling than running, and
the engine's quick compiles are tested against its full ones (tests/test_compile_cache.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jfire import programs
from jfire.programs import QUICK_COMPILE
from jfire.sampling import PenaltyState, RowSampling, init_penalty_state, mask_words, neutral_rows


_prefill = jax.jit(programs.prefill.__wrapped__,
                   static_argnames=("cfg", "attention", "layer_stack", "parallel", "cpu_matmul"),
                   donate_argnames=("pages", "penalties"), compiler_options=QUICK_COMPILE)
_decode = jax.jit(programs.decode.__wrapped__,
                  static_argnames=("cfg", "attention", "layer_stack", "parallel", "cpu_matmul"),
                  donate_argnames=("pages", "penalties"), compiler_options=QUICK_COMPILE)


def quick(fn, **jit_args):
    """`jax.jit(fn, **jit_args)` compiled with the quick compile's options."""
    return jax.jit(fn, compiler_options=QUICK_COMPILE, **jit_args)


def prefill(params, pages, tokens, positions, table, last, *, cfg, **kwargs):
    b, t = np.shape(tokens)
    out, logits, _, pages = _prefill(params, pages, tokens, positions, table, last,
                                     neutral_rows(b, cfg.vocab_size), init_penalty_state(1, cfg.vocab_size),
                                     np.full((b, t), -1, np.int32), cfg=cfg, **kwargs)
    return out.ids, logits, pages


def decode(params, pages, tokens, positions, table, *, cfg, **kwargs):
    b = np.shape(tokens)[0]
    out, logits, _, pages = _decode(params, pages, tokens, positions, table, neutral_rows(b, cfg.vocab_size),
                                    init_penalty_state(1, cfg.vocab_size), cfg=cfg, **kwargs)
    return out.ids, logits, pages


def abstract_sampling(rows: int, vocab_size: int, sharding) -> tuple[RowSampling, PenaltyState]:
    """Shapes of a decode program's sampling inputs, for `lower`."""
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    i32, f32 = jnp.int32, jnp.float32
    rows_in = RowSampling(s((rows,), jnp.uint32), s((rows,), f32), s((rows,), i32), s((rows,), f32),
                          s((rows, mask_words(vocab_size)), i32), s((rows,), f32), s((rows,), f32), s((rows,), f32),
                          s((rows,), i32), s((rows,), jnp.bool_))
    return rows_in, PenaltyState(s((1, vocab_size), i32), s((1, vocab_size), jnp.bool_))
