"""The Pallas prefill attention kernel (interpret mode) against the jnp paged reference and a
dense float64 numpy attention: ragged rows (cached prefixes of different lengths, chunks
ending mid-page, a row with no new tokens), GQA, sliding windows, chunked local attention,
float32 and bfloat16, over a shuffled page pool."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jfire.kernels.paged_attention import paged_attention_reference, paged_prefill_attention

LAYERS, KV_HEADS, HEAD_DIM, PAGE, PAGES_PER_ROW, T = 2, 2, 32, 4, 12, 16
# (cached prefix, new tokens) per row: from position 0, mid-page after a prefix, no new tokens
# (all padding), a full chunk after a long prefix ending mid-page.
ROWS = ((0, 7), (13, 5), (9, 0), (29, 16))
# float32: the kernel and the references differ only in summation order. bfloat16: the same
# bf16 inputs on both sides, but each side rounds its probabilities to bf16 before the value
# product against its own running max (the blocks differ), and the output to bf16 (2^-9
# relative): about 1% of the output's norm.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def make_case(seed, group, dtype, rows=ROWS):
    """q [b, T, h, d], positions [b, T], contiguous K/V per row [b, s, k, d] (float64), and the
    same K/V scattered over a shuffled pool of pages holding garbage elsewhere."""
    rng = np.random.default_rng(seed)
    b, s = len(rows), PAGES_PER_ROW * PAGE
    num_pages = b * PAGES_PER_ROW + 5
    as_dtype = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # noqa: E731
    k = as_dtype(rng.standard_normal((LAYERS, b, s, KV_HEADS, HEAD_DIM)))
    v = as_dtype(rng.standard_normal(k.shape))
    q = as_dtype(rng.standard_normal((b, T, KV_HEADS * group, HEAD_DIM)))
    table = rng.permutation(num_pages)[: b * PAGES_PER_ROW].reshape(b, PAGES_PER_ROW).astype(np.int32)
    k_pages = as_dtype(rng.standard_normal((LAYERS, KV_HEADS, num_pages, PAGE, HEAD_DIM)))
    v_pages = as_dtype(rng.standard_normal(k_pages.shape))
    for kv, pool in ((k, k_pages), (v, v_pages)):
        # [layers, b, pages, page, k, d] -> pool[layers, k, table[b, pages], page, d]
        paged = kv.reshape(LAYERS, b, PAGES_PER_ROW, PAGE, KV_HEADS, HEAD_DIM).transpose(0, 4, 1, 2, 3, 5)
        pool[:, :, table] = paged
    positions = np.full((b, T), -1, np.int32)
    for r, (prefix, new) in enumerate(rows):
        positions[r, :new] = np.arange(prefix, prefix + new)
    return q, k, v, k_pages, v_pages, table, positions


def dense(q, k, v, positions, window=None, chunk=None):
    """Causal attention per row over contiguous keys in float64: out [b, t, h, d], zeros for padding."""
    b, t, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros_like(q)
    for r in range(b):
        for i in range(t):
            p = positions[r, i]
            if p < 0:
                continue
            slots = np.arange(p + 1)
            if window is not None:
                slots = slots[slots > p - window]
            if chunk:
                slots = slots[slots // chunk == p // chunk]
            for head in range(h):
                scores = k[r, slots, head // g] @ q[r, i, head] / np.sqrt(d)
                w = np.exp(scores - scores.max())
                out[r, i, head] = (w / w.sum()) @ v[r, slots, head // g]
    return out


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


CASES = [  # (group, window, chunk, dtype)
    (1, None, None, jnp.float32),
    (4, None, None, jnp.float32),
    (1, 6, None, jnp.float32),
    (4, 6, None, jnp.float32),
    (1, None, 8, jnp.float32),
    (4, 10, 8, jnp.float32),
    (4, None, None, jnp.bfloat16),
    (1, 6, None, jnp.bfloat16),
    (4, None, 8, jnp.bfloat16),
]


@pytest.mark.parametrize("group,window,chunk,dtype", CASES)
def test_prefill_kernel_equals_paged_reference_and_dense(group, window, chunk, dtype):
    """Small blocks (16 query rows, 2 pages of keys), so a row's queries span several blocks
    and each block several key blocks; the chunk traced, as a scanned layer's would be."""
    q, k, v, k_pages, v_pages, table, positions = make_case(0, group, dtype)
    args = [jnp.asarray(x, dtype) for x in (q, k_pages, v_pages)]
    pos, tab, layer = jnp.asarray(positions), jnp.asarray(table), jnp.int32(1)
    traced = None if chunk is None else jnp.int32(chunk)
    got = paged_prefill_attention(args[0], args[1], args[2], layer, tab, pos, window, traced, block_rows=16,
                                  pages_per_block=2, interpret=True)  # fmt: skip
    assert got.shape == q.shape and got.dtype == dtype
    want = paged_attention_reference(args[0], args[1], args[2], layer, tab, pos, window, chunk)
    valid = positions >= 0
    assert np.all(np.asarray(got, np.float32)[~valid] == 0), "padding queries must give zeros"
    assert rel(got.astype(jnp.float32)[valid], want.astype(jnp.float32)[valid]) < TOLERANCE[dtype]
    exact = dense(q, k[1], v[1], positions, window, chunk)
    assert rel(got.astype(jnp.float32)[valid], exact[valid]) < TOLERANCE[dtype]


def test_default_blocks_and_static_chunk():
    """The default blocking (one block of query rows, 16 keys a block at this page size) and a
    static chunk, layer 0."""
    q, k, v, k_pages, v_pages, table, positions = make_case(1, 2, jnp.float32)
    got = paged_prefill_attention(jnp.asarray(q, jnp.float32), jnp.asarray(k_pages, jnp.float32),
                                  jnp.asarray(v_pages, jnp.float32), jnp.int32(0), jnp.asarray(table),
                                  jnp.asarray(positions), None, 8, interpret=True)  # fmt: skip
    valid = positions >= 0
    assert rel(got[valid], dense(q, k[0], v[0], positions, None, 8)[valid]) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("window,chunk", [(5, None), (None, 8)])
def test_reads_no_page_before_the_first_visible(window, chunk):
    """Every page before the first one a row's queries can see (the window's or the chunk's
    start) is NaN in the pool: the kernel must not read it (0 x NaN is NaN), while the rows
    start at different pages (one row's visible pages are another's invisible ones)."""
    rows = ((20, 6), (33, 11), (9, 3))
    q, k, v, k_pages, v_pages, table, positions = make_case(2, 2, jnp.float32, rows)
    for r, (prefix, _) in enumerate(rows):
        first = prefix - window + 1 if window else prefix // chunk * chunk
        for page in table[r, : max(first, 0) // PAGE]:
            k_pages[:, :, page] = np.nan
            v_pages[:, :, page] = np.nan
    got = paged_prefill_attention(jnp.asarray(q, jnp.float32), jnp.asarray(k_pages, jnp.float32),
                                  jnp.asarray(v_pages, jnp.float32), jnp.int32(1), jnp.asarray(table),
                                  jnp.asarray(positions), window, chunk, block_rows=16, pages_per_block=1,
                                  interpret=True)  # fmt: skip
    valid = positions >= 0
    assert np.isfinite(np.asarray(got)).all()
    assert rel(got[valid], dense(q, k[1], v[1], positions, window, chunk)[valid]) < TOLERANCE[jnp.float32]
