"""Decode attention over the paged KV cache for XLA:CPU (`cpu_attention.cc`).

Why: XLA's form of paged attention (`paged_attention_reference`) loops over blocks of pages,
gathering each block into a contiguous copy and transposing it before its products; at
decode sizes those copies and the dozen small kernels per block took about a fifth of a
batch-1 step of the default model (docs/performance.md). The kernel reads every key and value
where it lies in the stacked cache, once, and splits the work over fixed 256-position
segments, so a row's result does not depend on the batch it is in.

It serves the layer scans of a single-device CPU engine computing in float32, where the CPU
matmul kernels are on (`cpu_matmul.in_place`), for steps of a few tokens per row (decode); a prefill chunk's
attention is a batch of matrix products, which XLA's blocked GEMM does better.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jfire.kernels import cpu_matmul
from jfire.kernels.paged_attention import paged_attention_reference

MAX_TOKENS = 4  # query tokens per row up to which the kernel runs (decode is 1)


def applies(q, k_pages, chunk=None) -> bool:
    """Whether attention of q [b, t, h, d] over these pages runs on the kernel."""
    return chunk is None and q.shape[1] <= MAX_TOKENS and _kernel_serves(q, k_pages)


def _kernel_serves(q, k_pages) -> bool:
    """Whether the kernel can attend q over these pages at all, at any number of tokens a row."""
    return q.dtype == k_pages.dtype == jnp.float32 and cpu_matmul.in_place_enabled() and cpu_matmul.ready()


def paged_attention(q, k_pages, v_pages, layer, page_table, positions, sliding_window=None, chunk=None):
    """`paged_attention_reference`'s contract (q [b, t, h, d], pages [layers, kv_heads, num_pages,
    page_size, d], page_table [b, w], positions [b, t], -1 = padding -> zeros), on the kernel
    where it applies and on the reference otherwise."""
    if not applies(q, k_pages, chunk):
        return paged_attention_reference(
            q, k_pages, v_pages, layer, page_table, positions, sliding_window=sliding_window, chunk=chunk
        )
    return _kernel(q, k_pages, v_pages, layer, page_table, positions, sliding_window)


def _kernel(q, k_pages, v_pages, layer, page_table, positions, sliding_window):
    call = jax.ffi.ffi_call(cpu_matmul.target("jfire_paged_attention"), jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q,
        k_pages,
        v_pages,
        jnp.asarray(layer, jnp.int32).reshape(1),
        page_table.astype(jnp.int32),
        positions.astype(jnp.int32),
        sliding_window=np.int64(sliding_window or 0),
        scale=np.float32(1.0 / math.sqrt(q.shape[-1])),
    )


def decode_rows(q, k_pages, v_pages, layer, page_table, positions, sliding_window=None):
    """Each of q's t query tokens a row [b, t, h, d] attending on its own as a decode row at its
    position (`jfire.models.blocks.DecodeRows`: a speculative verify step), on the kernel, any
    t: the kernel's sums for a token are those of the token alone, and the tokens of a row that
    read the same keys run one after another, so the row's cache is read from memory once, not
    once a token. None where the kernel does not apply (the caller attends token by token)."""
    if not _kernel_serves(q, k_pages):
        return None
    return _kernel(q, k_pages, v_pages, layer, page_table, positions, sliding_window)


paged_attention.decode_rows = decode_rows  # type: ignore[attr-defined]  # found by DecodeRows
