"""Attention over the paged KV cache: a plain-jnp reference and a Pallas decode kernel.

Cache layout: pages [layers, kv_heads, num_pages, page_size, head_dim]; a row's page table
[pages_per_row] lists its pages in position order, so position p lives in slot
p % page_size of page page_table[p // page_size].

Both take the whole stacked cache and a layer index, so the layer loop never copies a
layer's slice of the pool out before attending to it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jfire.kernels.varying import vary_as

# A large finite negative: exp() of it is 0, and a fully masked block cannot make NaNs.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention(q, k, v, positions, sliding_window: int | None = None, chunk=None):
    """Grouped-query attention over contiguous keys: slot j holds position j.

    q [b, t, h, d]; k/v [b, s, k, d]; positions [b, t] (-1 = padding, which sees nothing).
    `chunk` (a static or traced scalar; <= 0 or None = off) is chunked local attention: a
    token sees only earlier tokens of its own chunk of that many positions (Llama 4).
    """
    b, t, h, d = q.shape
    kvh = k.shape[2]
    q = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    visible = _visible(jnp.arange(k.shape[1]), positions, sliding_window, chunk)  # [b, t, s]
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


# Keys a reference block reads at a time: the loop below runs to the longest row's length in
# steps of this many positions, so the page table can always be the full context wide.
BLOCK_POSITIONS = 256


def block_pages(page_size: int) -> int:
    """Pages per block of the reference attention loop (and the multiple a page table's width
    is rounded up to)."""
    return max(1, BLOCK_POSITIONS // page_size)


def visible_range(positions, page_size: int, pages_per_block: int, sliding_window=None, chunk=None):
    """(first, stop) block indices of a step: the blocks holding any position a valid query
    token of positions [b, t] (-1 = padding) can see. Computed in the program, so one program
    serves every context length up to its page table's width."""
    block = pages_per_block * page_size
    valid = positions >= 0
    first = jnp.zeros_like(positions)
    if sliding_window is not None:
        first = jnp.maximum(first, positions - sliding_window + 1)
    if chunk is not None:
        size = jnp.maximum(chunk, 1)
        first = jnp.where(chunk > 0, jnp.maximum(first, positions // size * size), first)
    big = jnp.iinfo(jnp.int32).max
    start = jnp.min(jnp.where(valid, first, big)) // block
    stop = (jnp.max(jnp.where(valid, positions, -1)) + block) // block
    return jnp.minimum(start, stop), stop


def paged_attention_reference(
    q,
    k_pages,
    v_pages,
    layer,
    page_table,
    positions,
    sliding_window=None,
    chunk=None,
    pages_per_block: int | None = None,
):
    """q [b, t, h, d] at positions [b, t]; pages as above; page_table [b, w]. Returns [b, t, h, d].

    Flash-style: a loop over blocks of `pages_per_block` pages (default: BLOCK_POSITIONS'
    worth), only to the longest row's last position, with an online softmax, so the work
    follows the rows' lengths and not the table's width."""
    b, t, h, d = q.shape
    _, kvh, _, page_size, _ = k_pages.shape
    g = h // kvh
    per_block = min(pages_per_block or block_pages(page_size), page_table.shape[1])
    table = pad_to_multiple(page_table, per_block)
    block = per_block * page_size
    qg = q.reshape(b, t, kvh, g, d)
    scale = 1.0 / math.sqrt(d)
    first, stop = visible_range(positions, page_size, per_block, sliding_window, chunk)

    def body(i, carry):
        ids = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)  # [b, bp]
        k = _block_keys(k_pages, layer, ids)
        v = _block_keys(v_pages, layer, ids)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
        slots = i * block + jnp.arange(block)
        visible = _visible(slots, positions, sliding_window, chunk)[:, None, None]  # [b, 1, 1, t, s]
        return online_softmax_step(
            carry,
            s,
            visible,
            lambda p: jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32),
        )

    # Inside a shard_map the body's results vary as its inputs: so must the initial carry.
    init = vary_as(online_softmax_init((b, kvh, g, t), d), q, k_pages, v_pages, table, positions)
    _, l, acc = jax.lax.fori_loop(first, stop, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # a padding token (l = 0) gets zeros
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def online_softmax_init(shape: tuple[int, ...], width: int):
    """(m, l, acc) before the first block: running max, sum and weighted sum [*shape, width]."""
    return (
        jnp.full(shape, MASK_VALUE, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, width), jnp.float32),
    )


def online_softmax_step(carry, s, visible, weigh):
    """One block of an online softmax: the carry (m, l, acc) updated with scores s [..., keys]
    (float32), where `visible` says which keys count, and weigh(p) the block's values
    weighted by p [..., keys] (-> [..., width])."""
    m, l, acc = carry
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    # Masked keys weigh exactly 0, even in a block no query sees (where s - m_new is 0).
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    return m_new, l * correction + p.sum(axis=-1), acc * correction[..., None] + weigh(p)


def pad_to_multiple(page_table, multiple: int):
    """The table padded with page 0 to a multiple of `multiple` columns (the padding is never
    visible: it lies past every row's positions)."""
    extra = -page_table.shape[1] % multiple
    return jnp.pad(page_table, ((0, 0), (0, extra))) if extra else page_table


def _block_keys(pages, layer, ids):
    """One layer's pages ids [b, bp] of each row, laid out contiguously: [b, bp * page_size, k, d]."""
    rows = pages[layer, :, ids]  # [b, bp, k, page_size, d]
    b, bp, kvh, ps, d = rows.shape
    return rows.transpose(0, 1, 3, 2, 4).reshape(b, bp * ps, kvh, d)


def _visible(slots, positions, sliding_window, chunk):
    """[b, t, s]: which cache slots each query token at positions [b, t] sees (causal, then the
    sliding window and chunked local attention as in `attention`)."""
    visible = slots[None, None, :] <= positions[:, :, None]
    if sliding_window is not None:
        visible &= slots[None, None, :] > positions[:, :, None] - sliding_window
    if chunk is not None:
        size = jnp.maximum(chunk, 1)
        visible &= (chunk <= 0) | (slots[None, None, :] // size == positions[:, :, None] // size)
    return visible


# -- the Pallas decode kernel ------------------------------------------------------------------


def _decode_kernel(
    layer_ref,
    chunk_ref,
    table_ref,
    length_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    page_size: int,
    pages_per_block: int,
    num_blocks: int,
    scale: float,
    sliding_window: int | None,
):
    """One (row, kv head) pair: online softmax over the row's pages, a block of pages at a time.

    q_ref [g, d] holds the query heads sharing this kv head (padded to a dot-friendly count);
    k_ref/v_ref [layers, pages, page_size, d] are this kv head's whole pool, read page by page
    through the row's page table (a gather, never a copy of the pool).
    """
    layer = layer_ref[0]
    length = length_ref[0]
    q = q_ref[...].astype(jnp.float32) * scale  # [g, d]
    g, d = q.shape
    block = pages_per_block * page_size
    first_visible = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    # Chunked local attention: the query (at length - 1) sees only its own chunk.
    chunk = chunk_ref[0]
    first_visible = jnp.where(
        chunk > 0, jnp.maximum(first_visible, (length - 1) // jnp.maximum(chunk, 1) * chunk), first_visible
    )

    def body(i, carry):
        m, l, acc = carry
        pages = table_ref[pl.ds(i * pages_per_block, pages_per_block)]
        k = k_ref[layer, pages].reshape(block, d).astype(jnp.float32)
        v = v_ref[layer, pages].reshape(block, d).astype(jnp.float32)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())))  # [g, block]
        slot = i * block + jax.lax.broadcasted_iota(jnp.int32, (g, block), 1)
        s = jnp.where((slot < length) & (slot >= first_visible), s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[:, None])
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[:, None] + jax.lax.dot(p, v)
        return m_new, l, acc

    # Only blocks that hold visible positions are read.
    start = first_visible // block
    stop = jnp.minimum((length + block - 1) // block, num_blocks)
    init = (jnp.full((g,), MASK_VALUE, jnp.float32), jnp.zeros((g,), jnp.float32), jnp.zeros((g, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(start, stop, body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sliding_window", "pages_per_block", "interpret", "num_warps"))
def paged_attention(
    q,
    k_pages,
    v_pages,
    layer,
    page_table,
    lengths,
    *,
    sliding_window=None,
    chunk=0,
    pages_per_block: int = 8,
    interpret: bool = False,
    num_warps: int = 4,
):
    """Decode attention with a Pallas (Triton-style GPU) kernel: one query per row.

    q [b, h, d]; k/v pages [layers, k, num_pages, page_size, d]; layer a scalar; page_table
    [b, w]; lengths [b] (the query sits at position length-1 and sees positions < length);
    chunk a scalar, > 0 for chunked local attention (may be traced: it varies per layer).
    Returns [b, h, d].
    """
    from jax.experimental.pallas import triton as plgpu

    b, h, d = q.shape
    layers, kvh, num_pages, page_size, _ = k_pages.shape
    g = h // kvh
    pages_per_block = min(pages_per_block, page_table.shape[1])
    page_table = pad_to_multiple(page_table, pages_per_block)
    w = page_table.shape[1]
    # GPU dot products want at least 16 rows: pad the query heads of a group.
    g_pad = max(16, 1 << (g - 1).bit_length())
    q = jnp.pad(q.reshape(b, kvh, g, d), ((0, 0), (0, 0), (0, g_pad - g), (0, 0)))
    kernel = functools.partial(
        _decode_kernel,
        page_size=page_size,
        pages_per_block=pages_per_block,
        num_blocks=w // pages_per_block,
        scale=1.0 / math.sqrt(d),
        sliding_window=sliding_window,
    )
    pool = pl.BlockSpec((layers, None, num_pages, page_size, d), lambda i, j: (0, j, 0, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(b, kvh),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),  # layer
            pl.BlockSpec((1,), lambda i, j: (0,)),  # chunk
            pl.BlockSpec((None, w), lambda i, j: (i, 0)),  # this row's page table
            pl.BlockSpec((1,), lambda i, j: (i,)),  # this row's length
            pl.BlockSpec((None, None, g_pad, d), lambda i, j: (i, j, 0, 0)),
            pool,
            pool,
        ],
        out_specs=pl.BlockSpec((None, None, g_pad, d), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, g_pad, d), q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        name="jfire_paged_decode_attention",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        jnp.reshape(chunk, (1,)).astype(jnp.int32),
        page_table.astype(jnp.int32),
        lengths.astype(jnp.int32),
        q,
        k_pages,
        v_pages,
    )
    return out[:, :, :g].reshape(b, h, d)


# -- the Pallas prefill kernel -----------------------------------------------------------------


def _prefill_kernel(
    layer_ref,
    chunk_ref,
    table_ref,
    pos_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    page_size: int,
    pages_per_block: int,
    scale: float,
    sliding_window: int | None,
    precision,
):
    """One (row, block of query rows, kv head): flash attention over the pages the block sees.

    q_ref [m, d] holds query rows (token, head of this kv head's group) in that order and
    pos_ref [m] each one's position (-1 = padding); k_ref/v_ref [layers, pages, page_size, d]
    are this kv head's whole pool, read a block of pages at a time through the row's page
    table, from the first page any of the block's queries sees to the page of its last one.
    """
    layer = layer_ref[0]
    chunk = chunk_ref[0]
    pos = pos_ref[...]
    q = q_ref[...]
    m_rows, d = q.shape
    block = pages_per_block * page_size
    size = jnp.maximum(chunk, 1)
    first = jnp.zeros_like(pos)
    if sliding_window is not None:
        first = jnp.maximum(first, pos - (sliding_window - 1))
    first = jnp.where(chunk > 0, jnp.maximum(first, pos // size * size), first)
    last = jnp.max(pos)  # -1: a block of padding, which reads nothing
    lo = jnp.minimum(jnp.min(jnp.where(pos >= 0, first, jnp.iinfo(jnp.int32).max)), jnp.maximum(last, 0))
    start_page = lo // page_size
    pages = jnp.maximum((last + page_size) // page_size - start_page, 0)
    num_blocks = (pages + pages_per_block - 1) // pages_per_block

    def body(i, carry):
        m, l, acc = carry
        page0 = start_page + i * pages_per_block
        ids = table_ref[pl.ds(page0, pages_per_block)]
        k = k_ref[layer, ids].reshape(block, d)
        v = v_ref[layer, ids].reshape(block, d)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        s = s * scale
        slot = page0 * page_size + jax.lax.broadcasted_iota(jnp.int32, (m_rows, block), 1)
        at = pos[:, None]
        visible = slot <= at
        if sliding_window is not None:
            visible &= slot > at - sliding_window
        visible &= (chunk <= 0) | (slot // size == at // size)
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        # Masked keys weigh exactly 0, even for a query that sees nothing in this block.
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        return m_new, l, acc * correction[:, None] + pv

    init = (
        jnp.full((m_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
        jnp.zeros((m_rows, d), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)  # padding: zeros


def prefill_blocks(tokens: int, group: int, page_size: int) -> tuple[int, int]:
    """(query rows, pages) per block of the prefill kernel by default: up to 128 rows of
    (token, head) pairs, and 64 keys' worth of pages (Triton wants powers of two)."""
    rows = min(128, max(16, 1 << (tokens * group - 1).bit_length()))
    return rows, max(1, 64 // page_size)


@functools.partial(
    jax.jit, static_argnames=("sliding_window", "block_rows", "pages_per_block", "interpret", "num_warps", "num_stages")
)
def paged_prefill_attention(
    q,
    k_pages,
    v_pages,
    layer,
    page_table,
    positions,
    sliding_window=None,
    chunk=None,
    *,
    block_rows: int | None = None,
    pages_per_block: int | None = None,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int = 2,
):
    """Prefill chunks (any number of tokens a row) with a Pallas (Triton-style GPU) flash kernel:
    `paged_attention_reference`'s arguments and result, its masks exactly.

    Rows are ragged: each row's queries sit at its positions [b, t] (-1 = padding; a row may
    be all padding) after a cached prefix of any length, and see that row's pages up to
    their own position. A kv head's g query heads are laid out as g * t query rows (token
    major), so a block of rows shares every page it reads. `chunk` (None, or a static or
    traced scalar, <= 0 = off) is chunked local attention (Llama 4).
    """
    from jax.experimental.pallas import triton as plgpu

    b, t, h, d = q.shape
    layers, kvh, num_pages, page_size, _ = k_pages.shape
    g = h // kvh
    default_rows, default_pages = prefill_blocks(t, g, page_size)
    block_rows = block_rows or default_rows
    pages_per_block = pages_per_block or default_pages
    rows = t * g
    blocks = -(-rows // block_rows)
    pad = blocks * block_rows - rows
    qr = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, pad), (0, 0)))
    pos = jnp.pad(jnp.repeat(positions.astype(jnp.int32), g, axis=1), ((0, 0), (0, pad)), constant_values=-1)
    # A block may run past the row's last page: page 0 there, never visible.
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, pages_per_block)))
    w = table.shape[1]
    kernel = functools.partial(
        _prefill_kernel,
        page_size=page_size,
        pages_per_block=pages_per_block,
        scale=1.0 / math.sqrt(d),
        sliding_window=sliding_window,
        # Float32 stays IEEE on Triton (not TF32); bfloat16 takes bfloat16 tensor-core dots.
        precision=jax.lax.Precision.HIGHEST if k_pages.dtype == jnp.float32 else None,
    )
    pool = pl.BlockSpec((layers, None, num_pages, page_size, d), lambda i, j, k: (0, k, 0, 0, 0))
    rows_spec = pl.BlockSpec((None, None, block_rows, d), lambda i, j, k: (i, k, j, 0))
    out = pl.pallas_call(
        kernel,
        grid=(b, blocks, kvh),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, k: (0,)),  # layer
            pl.BlockSpec((1,), lambda i, j, k: (0,)),  # chunk
            pl.BlockSpec((None, w), lambda i, j, k: (i, 0)),  # this row's page table
            pl.BlockSpec((None, block_rows), lambda i, j, k: (i, j)),  # the block's positions
            rows_spec,
            pool,
            pool,
        ],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or (4 if d <= 64 else 8), num_stages=num_stages),
        name="jfire_paged_prefill_attention",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        jnp.reshape(0 if chunk is None else chunk, (1,)).astype(jnp.int32),
        table,
        pos,
        qr,
        k_pages,
        v_pages,
    )
    return out[:, :, :rows].reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
