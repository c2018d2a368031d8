"""Multi-head latent attention (DeepSeek-V3, Kimi K2) over a paged latent cache, in the
absorbed form: the cache holds per token only the normalised latent and the shared rope
key, `[layers, pages, page_size, latent + rope]`, and never per-head keys or values.

The caller folds the key half of `kv_b_proj` into the query (q_latent = q_nope W_UK, one
`latent`-wide vector per head) and applies the value half after attention, so attention
itself reads only the cache:

    score(h, s) = (q_latent[h] . latent[s] + q_rope[h] . rope_key[s]) * scale
    out[h]      = sum_s softmax(score)[h, s] latent[s]            (then W_UV, outside)

The pages may be split over devices (sequence-sharded: each device holds a contiguous range
of page ids, `first_page` being its first). Each device attends over the pages it holds and
returns a partial softmax (running max, sum, unnormalised output); `combine_partials` merges
the devices' partials exactly, the way flash-decoding merges blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfire.kernels.paged_attention import (
    MASK_VALUE,
    block_pages,
    online_softmax_init,
    online_softmax_step,
    pad_to_multiple,
    visible_range,
)
from jfire.kernels.varying import vary_as


def local_pages(page_table, first_page, num_local: int):
    """(page ids relative to this device's range, clipped into it; whether each is held here)."""
    local = page_table - first_page
    held = (local >= 0) & (local < num_local)
    return jnp.clip(local, 0, num_local - 1), held


def mla_partial_reference(
    q_latent,
    q_rope,
    cache,
    layer,
    page_table,
    positions,
    *,
    scale: float,
    first_page=0,
    pages_per_block: int | None = None,
):
    """Attention of q_latent [b, t, h, c] and q_rope [b, t, h, r] at positions [b, t] (-1 =
    padding, which sees nothing) over the pages this device holds of cache
    [layers, pages, page_size, c + r]; page_table [b, w] holds global page ids.

    Returns the partial (acc [b, t, h, c], m [b, t, h], l [b, t, h]), float32: out = acc / l
    once every device's partial is combined. A loop over blocks of `pages_per_block` pages,
    only to the longest row's last position (as jfire.kernels.paged_attention's reference)."""
    c = q_latent.shape[-1]
    num_local, page_size = cache.shape[1], cache.shape[2]
    b, t, h, _ = q_latent.shape
    per_block = min(pages_per_block or block_pages(page_size), page_table.shape[1])
    table = pad_to_multiple(page_table, per_block)
    block = per_block * page_size
    first, stop = visible_range(positions, page_size, per_block)

    def body(i, carry):
        ids, held = local_pages(
            jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1), first_page, num_local
        )
        kv = cache[layer, ids].reshape(b, block, -1)  # [b, block, c + r]
        latent, rope_key = kv[..., :c], kv[..., c:]
        s = (
            jnp.einsum("bthc,bsc->bths", q_latent, latent, preferred_element_type=jnp.float32)
            + jnp.einsum("bthr,bsr->bths", q_rope, rope_key, preferred_element_type=jnp.float32)
        ) * scale
        slots = i * block + jnp.arange(block)
        visible = (slots[None, None, :] <= positions[:, :, None]) & jnp.repeat(held, page_size, axis=1)[:, None, :]
        return online_softmax_step(
            carry,
            s,
            visible[:, :, None, :],
            lambda p: jnp.einsum("bths,bsc->bthc", p.astype(latent.dtype), latent, preferred_element_type=jnp.float32),
        )

    # Inside a shard_map the body's results vary as its inputs: so must the initial carry.
    init = vary_as(online_softmax_init((b, t, h), c), q_latent, q_rope, cache, table, positions)
    m, l, acc = jax.lax.fori_loop(first, stop, body, init)
    return acc, m, l


def combine_partials(acc, m, l, axis_name=None):
    """The attention output [..., c] (float32) from partials; with `axis_name`, the partials
    of every device along those mesh axes are merged first (inside a shard_map)."""
    if axis_name is not None:
        top = jax.lax.pmax(m, axis_name)
        correction = jnp.exp(m - top)
        acc = jax.lax.psum(acc * correction[..., None], axis_name)
        l = jax.lax.psum(l * correction, axis_name)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def write_latent(cache, layer, page, slot, entry, first_page=0):
    """Writes entry [b, t, c + r] into cache [layers, pages, page_size, c + r] at global
    (page, slot) [b, t]; pages outside this device's range (and padding) are dropped."""
    local = page - first_page
    local = jnp.where((local >= 0) & (local < cache.shape[1]), local, cache.shape[1])
    return cache.at[layer, local, slot].set(entry.astype(cache.dtype), mode="drop")


def _attend_latent_pages(
    ql, qr, last, cache_ref, table_ref, layer, first, stop, *, page_size, pages_per_block, scale, precision
):
    """(m, l, acc) of query rows ql [n, c] / qr [n, r] over a row's latent pages, inside a
    Pallas kernel: an online softmax over blocks 0..stop of `pages_per_block` pages read
    through table_ref, each query row seeing the positions up to its own `last` [n] (-1:
    nothing). cache_ref [layers, pages, page_size, c + r] is this device's whole pool, local
    page ids the table's less `first`: a page not held here (or past every row's last) is
    never read, by masked loads within a block and a skipped block where none is. The
    decode kernel (every row of a block at one position) and the prefill kernel share it."""
    num_local = cache_ref.shape[1]
    n, c = ql.shape
    r = qr.shape[1]
    block = pages_per_block * page_size
    dims = (((1,), (1,)), ((), ()))  # [n, x] . [block, x] -> [n, block]
    newest = jnp.max(last)

    def attend(i, ids, ok, carry):
        m, l, acc = carry

        # A page this device does not hold (or past the last position) is never read: its
        # lanes of the load are masked off, and Triton issues no memory access for masked
        # lanes. The ids were clamped into the pool, so even the (unused) addresses stay in
        # bounds.
        def gather(start, size):  # [block, size] of every page's entries, columns start:start+size
            shape = (pages_per_block, page_size, size)
            # Whole-array indices (not slices): the form both Triton and interpret mode gather.
            index = (
                layer,
                jnp.broadcast_to(ids[:, None, None], shape),
                jax.lax.broadcasted_iota(jnp.int32, shape, 1),
                start + jax.lax.broadcasted_iota(jnp.int32, shape, 2),
            )
            mask = jnp.broadcast_to(ok[:, None, None], shape)
            return plgpu.load(cache_ref.at[index], mask=mask, other=0.0).reshape(block, size).astype(ql.dtype)

        latent, rope_key = gather(0, c), gather(c, r)
        s = (
            jax.lax.dot_general(ql, latent, dims, precision=precision, preferred_element_type=jnp.float32)
            + jax.lax.dot_general(qr, rope_key, dims, precision=precision, preferred_element_type=jnp.float32)
        ) * scale
        slot = i * block + jax.lax.broadcasted_iota(jnp.int32, (n, block), 1)
        held = jnp.broadcast_to(ok.astype(jnp.int32)[:, None], (pages_per_block, page_size)).reshape(1, block)
        visible = (slot <= last[:, None]) & (held > 0)
        m_new = jnp.maximum(m, jnp.where(visible, s, MASK_VALUE).max(axis=-1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        pv = jax.lax.dot(p.astype(ql.dtype), latent, precision=precision, preferred_element_type=jnp.float32)
        return m_new, l, acc * correction[:, None] + pv

    def body(i, carry):
        local = table_ref[pl.ds(i * pages_per_block, pages_per_block)] - first
        page = i * pages_per_block + jax.lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
        ok = (local >= 0) & (local < num_local) & (page * page_size <= newest)
        ids = jnp.clip(local, 0, num_local - 1)
        # Skipping pages not held here (or past the last position), in two layers: a block
        # with none of them (common when the pool is sequence-sharded) is skipped outright by
        # a branch (an scf.if in Triton): no loads, no dots; within a block the skip is per
        # page, by the masked load in `attend`. Clamp + mask alone (as the reference does)
        # would still read the clamped pages; a branch per page would shrink every dot to
        # page_size keys (pages_per_block=1 is exactly that), and Triton dots want >= 16.
        return jax.lax.cond(ok.astype(jnp.int32).max() > 0, functools.partial(attend, i, ids, ok), lambda x: x, carry)

    init = (jnp.full((n,), MASK_VALUE, jnp.float32), jnp.zeros((n,), jnp.float32), jnp.zeros((n, c), jnp.float32))
    return jax.lax.fori_loop(0, stop, body, init)


# -- the Pallas decode kernel ------------------------------------------------------------------


def _mla_decode_kernel(
    layer_ref,
    first_ref,
    table_ref,
    length_ref,
    ql_ref,
    qr_ref,
    cache_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    page_size: int,
    pages_per_block: int,
    num_blocks: int,
    scale: float,
):
    """One (row, block of query heads): online softmax over the row's pages, a block at a time.

    ql_ref [g, c] / qr_ref [g, r] hold this block's query heads (padded to a dot-friendly
    count); cache_ref [layers, pages, page_size, c + r] is this device's whole pool, read
    page by page through the row's page table (a gather, never a copy of the pool).
    """
    layer, first, length = layer_ref[0], first_ref[0], length_ref[0]
    ql, qr = ql_ref[...], qr_ref[...]
    g = ql.shape[0]
    dtype = jnp.result_type(ql.dtype, qr.dtype, cache_ref.dtype)
    ql, qr = ql.astype(dtype), qr.astype(dtype)
    block = pages_per_block * page_size
    # Only blocks that hold visible positions are visited (none for an empty row).
    stop = jnp.minimum((length + block - 1) // block, num_blocks)
    m, l, acc = _attend_latent_pages(
        ql,
        qr,
        jnp.full((g,), length - 1, jnp.int32),
        cache_ref,
        table_ref,
        layer,
        first,
        stop,
        page_size=page_size,
        pages_per_block=pages_per_block,
        scale=scale,
        # Float32 accumulation always; HIGHEST keeps float32 inputs IEEE on Triton (not TF32),
        # and leaves bfloat16 inputs bfloat16 tensor-core dots.
        precision=jax.lax.Precision.HIGHEST,
    )
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "heads_per_block", "interpret", "num_warps"))
def mla_paged_decode(
    q_latent,
    q_rope,
    cache,
    layer,
    page_table,
    lengths,
    *,
    scale: float,
    first_page=0,
    pages_per_block: int = 2,
    heads_per_block: int = 16,
    interpret: bool = False,
    num_warps: int = 4,
):
    """Decode MLA with a Pallas (Triton-style GPU) kernel: one query per row, the partial
    softmax of `mla_partial_reference` at positions = lengths - 1.

    q_latent [b, h, c], q_rope [b, h, r]; cache [layers, pages, page_size, c + r] holds this
    device's global pages [first_page, first_page + pages); layer and first_page scalars (may
    be traced); page_table [b, w] global page ids; lengths [b] (the query sits at position
    length - 1 and sees positions < length; 0 = an empty row). Pages not held here count
    for nothing and are not read. Returns (acc [b, h, c], m [b, h], l [b, h]), float32,
    for `combine_partials`.

    The latent has no head axis, so all heads of a row read the same pages: the grid is
    (block of heads, row), the heads padded to a power of two >= 16 (GPU dots want 16
    rows) and split into blocks of `heads_per_block` (a power of two >= 16) so the
    float32 accumulator [heads_per_block, c] stays in registers (c = 512: 16 heads are
    64 registers a thread at 4 warps). The head-block axis is the first (CUDA x, launched
    fastest), so a row's programs run side by side and share its pages through L2. `w`
    need not be a multiple of `pages_per_block`: the table is padded with pages past every
    length. The defaults are unmeasured guesses; tune them on the GPU.
    """
    b, h, c = q_latent.shape
    r = q_rope.shape[-1]
    layers, num_local, page_size, width = cache.shape
    if width != c + r:
        raise ValueError(f"cache entries hold {width} values, the queries {c} + {r}")
    if heads_per_block < 16 or heads_per_block & (heads_per_block - 1):
        raise ValueError(f"heads_per_block ({heads_per_block}) must be a power of two >= 16")
    h_pad = max(16, 1 << (h - 1).bit_length())
    hb = min(heads_per_block, h_pad)
    w = page_table.shape[1]
    pages_per_block = max(1, min(pages_per_block, w))
    num_blocks = -(-w // pages_per_block)
    # Padding columns sit past w * page_size >= every visible slot: never visible, never read.
    page_table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, num_blocks * pages_per_block - w)))
    q_latent = jnp.pad(q_latent, ((0, 0), (0, h_pad - h), (0, 0)))
    q_rope = jnp.pad(q_rope, ((0, 0), (0, h_pad - h), (0, 0)))
    kernel = functools.partial(
        _mla_decode_kernel,
        page_size=page_size,
        pages_per_block=pages_per_block,
        num_blocks=num_blocks,
        scale=float(scale),
    )
    scalar = pl.BlockSpec((1,), lambda j, i: (0,))
    heads = pl.BlockSpec((None, hb), lambda j, i: (i, j))
    acc, m, l = pl.pallas_call(
        kernel,
        # Grid dimension 0 is CUDA x, the fastest-launched: the head blocks of a row go together.
        grid=(h_pad // hb, b),
        in_specs=[
            scalar,  # layer
            scalar,  # first_page
            pl.BlockSpec((None, num_blocks * pages_per_block), lambda j, i: (i, 0)),  # this row's page table
            pl.BlockSpec((1,), lambda j, i: (i,)),  # this row's length
            pl.BlockSpec((None, hb, c), lambda j, i: (i, j, 0)),
            pl.BlockSpec((None, hb, r), lambda j, i: (i, j, 0)),
            pl.BlockSpec(cache.shape, lambda j, i: (0, 0, 0, 0)),  # the whole pool
        ],
        out_specs=[pl.BlockSpec((None, hb, c), lambda j, i: (i, j, 0)), heads, heads],
        out_shape=[
            jax.ShapeDtypeStruct((b, h_pad, c), jnp.float32),
            jax.ShapeDtypeStruct((b, h_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, h_pad), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        name="jfire_mla_paged_decode",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        jnp.reshape(first_page, (1,)).astype(jnp.int32),
        page_table,
        lengths.astype(jnp.int32),
        q_latent,
        q_rope,
        cache,
    )
    return acc[:, :h], m[:, :h], l[:, :h]


# -- the Pallas prefill kernel -----------------------------------------------------------------


def _mla_prefill_kernel(
    layer_ref,
    first_ref,
    table_ref,
    pos_ref,
    ql_ref,
    qr_ref,
    cache_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    page_size: int,
    pages_per_block: int,
    scale: float,
    precision,
):
    """One (row, block of query rows): flash attention over the row's pages held here, from
    page 0 to the page of the block's last position.

    ql_ref [m, c] / qr_ref [m, r] hold query rows (token, head) in that order and pos_ref [m]
    each one's position (-1 = padding); cache_ref [layers, pages, page_size, c + r] is this
    device's whole pool, read a block of pages at a time through the row's page table; a
    page not held here is not read (masked loads, and a block with none is skipped).
    """
    pos = pos_ref[...]
    last = jnp.max(pos)  # -1: a block of padding, which reads nothing
    block = pages_per_block * page_size
    m, l, acc = _attend_latent_pages(
        ql_ref[...],
        qr_ref[...],
        pos,
        cache_ref,
        table_ref,
        layer_ref[0],
        first_ref[0],
        (last + block) // block,
        page_size=page_size,
        pages_per_block=pages_per_block,
        scale=scale,
        precision=precision,
    )
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("scale", "block_rows", "pages_per_block", "interpret", "num_warps"))
def mla_paged_prefill(
    q_latent,
    q_rope,
    cache,
    layer,
    page_table,
    positions,
    *,
    scale: float,
    first_page=0,
    block_rows: int = 32,
    pages_per_block: int = 2,
    interpret: bool = False,
    num_warps: int = 8,
):
    """Prefill MLA (absorbed form) with a Pallas (Triton-style GPU) flash kernel: exactly
    `mla_partial_reference`'s arguments and partial result, for chunks of any length.

    q_latent [b, t, h, c], q_rope [b, t, h, r] at positions [b, t] (-1 = padding; rows
    ragged, each after its cached prefix); cache [layers, pages, page_size, c + r] holds
    this device's global pages [first_page, first_page + pages); page_table [b, w] global
    page ids. Returns (acc [b, t, h, c], m [b, t, h], l [b, t, h]), float32.

    The latent has no head axis, so a row's h heads and t tokens are t x h query rows
    (token major) sharing every page; the grid is (row, block of `block_rows` query rows).
    The float32 accumulator [block_rows, c] bounds the block (c = 512: 32 rows are 64
    registers a thread at 8 warps). The defaults are unmeasured guesses; tune them on the GPU.
    """
    b, t, h, c = q_latent.shape
    r = q_rope.shape[-1]
    layers, num_local, page_size, width = cache.shape
    if width != c + r:
        raise ValueError(f"cache entries hold {width} values, the queries {c} + {r}")
    rows = t * h
    block_rows = min(block_rows, max(16, 1 << (rows - 1).bit_length()))
    blocks = -(-rows // block_rows)
    pad = blocks * block_rows - rows
    ql = jnp.pad(q_latent.reshape(b, rows, c), ((0, 0), (0, pad), (0, 0)))
    qr = jnp.pad(q_rope.reshape(b, rows, r), ((0, 0), (0, pad), (0, 0)))
    dtype = jnp.result_type(ql.dtype, qr.dtype, cache.dtype)
    ql, qr = ql.astype(dtype), qr.astype(dtype)
    pos = jnp.pad(jnp.repeat(positions.astype(jnp.int32), h, axis=1), ((0, 0), (0, pad)), constant_values=-1)
    # A block may run past the row's last page: padding columns there, never visible, never read.
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, pages_per_block)))
    kernel = functools.partial(
        _mla_prefill_kernel,
        page_size=page_size,
        pages_per_block=pages_per_block,
        scale=float(scale),
        precision=jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None,
    )
    scalar = pl.BlockSpec((1,), lambda i, j: (0,))
    block = pl.BlockSpec((None, block_rows), lambda i, j: (i, j))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, blocks),
        in_specs=[
            scalar,  # layer
            scalar,  # first_page
            pl.BlockSpec((None, table.shape[1]), lambda i, j: (i, 0)),  # this row's page table
            block,  # the block's positions
            pl.BlockSpec((None, block_rows, c), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, block_rows, r), lambda i, j: (i, j, 0)),
            pl.BlockSpec(cache.shape, lambda i, j: (0, 0, 0, 0)),  # the whole pool
        ],
        out_specs=[pl.BlockSpec((None, block_rows, c), lambda i, j: (i, j, 0)), block, block],
        out_shape=[
            jax.ShapeDtypeStruct((b, rows + pad, c), jnp.float32),
            jax.ShapeDtypeStruct((b, rows + pad), jnp.float32),
            jax.ShapeDtypeStruct((b, rows + pad), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        name="jfire_mla_paged_prefill",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        jnp.reshape(first_page, (1,)).astype(jnp.int32),
        table,
        pos,
        ql,
        qr,
        cache,
    )
    return acc[:, :rows].reshape(b, t, h, c), m[:, :rows].reshape(b, t, h), l[:, :rows].reshape(b, t, h)


# -- the expanded form, for long prefill chunks -------------------------------------------------
#
# FLOPs of one row's chunk of `tokens` queries after `cached` positions (causal), with H heads,
# latent c, rope r, per-head nope dn and value dv widths (multiply-adds count 2):
#   pairs    = tokens * cached + tokens * (tokens + 1) / 2      (query, position) pairs seen
#   absorbed = 2 H (2c + r) pairs                              scores over c + r, values over c
#            + 2 tokens H c (dn + dv)                          q_nope W_UK before, out W_UV after
#   expanded = 2 H (dn + r + dv) pairs                         scores over dn + r, values over dv
#            + 2 (cached + tokens) c H (dn + dv)               K = latent W_UK, V = latent W_UV
# The per-token projections equal the expansion of the chunk's own positions, so the
# difference is pairs * 2H (2c - dn - dv) against cached * 2 c H (dn + dv): with a long prefix
# the expanded form wins once tokens > c (dn + dv) / (2c - dn - dv) (DeepSeek-V3 / Kimi K2:
# 512 * 256 / 768 = 170.7 tokens), whatever the prefix; below that it wins only while the
# prefix is short enough. The caller evaluates the rule at the longest prefix its page
# table allows (the cached positions are traced, the choice is static), so a chunk below
# the threshold stays absorbed: never the more expensive form at long contexts.


def mla_prefill_flops(tokens: int, cached: int, *, heads: int, latent: int, rope: int, nope: int, v: int) -> dict:
    """{"absorbed": FLOPs, "expanded": FLOPs} of one row's chunk (see the comment above)."""
    pairs = tokens * cached + tokens * (tokens + 1) // 2
    return {
        "absorbed": 2 * heads * (2 * latent + rope) * pairs + 2 * tokens * heads * latent * (nope + v),
        "expanded": 2 * heads * (nope + rope + v) * pairs + 2 * (cached + tokens) * latent * heads * (nope + v),
    }


def mla_prefill_form(tokens: int, cached: int, **dims) -> str:
    """ "expanded" or "absorbed": the cheaper in FLOPs for `tokens` queries after `cached`
    positions (ties and one-token steps stay absorbed)."""
    if tokens <= 1:
        return "absorbed"
    flops = mla_prefill_flops(tokens, cached, **dims)
    return "expanded" if flops["expanded"] < flops["absorbed"] else "absorbed"


def merge_partials(a, b):
    """Two partials (acc, m, l) over disjoint positions merged into one, exactly."""
    (acc_a, m_a, l_a), (acc_b, m_b, l_b) = a, b
    m = jnp.maximum(m_a, m_b)
    ca, cb = jnp.exp(m_a - m), jnp.exp(m_b - m)
    return acc_a * ca[..., None] + acc_b * cb[..., None], m, l_a * ca + l_b * cb


def _expanded_kernel(
    start_ref,
    qpos_ref,
    kpos_ref,
    qn_ref,
    qr_ref,
    k_ref,
    kr_ref,
    v_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    block_keys: int,
    scale: float,
    precision,
):
    """One (row, block of queries, head): flash attention over one span of expanded keys
    (k_ref [span, dn], kr_ref [span, r] the shared rope key, v_ref [span, dv]) whose
    positions are start + 0..span-1 (kpos_ref: those positions, or a huge value where the
    page is not held here), as far as the block's last query position."""
    start = start_ref[0]
    qpos = qpos_ref[...]
    qn, qr = qn_ref[...], qr_ref[...]
    rows = qn.shape[0]
    span, dv = v_ref.shape
    dims = (((1,), (1,)), ((), ()))
    last = jnp.max(qpos)
    num_blocks = jnp.clip((last - start + block_keys) // block_keys, 0, span // block_keys)

    def body(i, carry):
        m, l, acc = carry
        keys = pl.ds(i * block_keys, block_keys)
        k, kr, v, kpos = k_ref[keys, :], kr_ref[keys, :], v_ref[keys, :], kpos_ref[keys]
        s = (
            jax.lax.dot_general(qn, k, dims, precision=precision, preferred_element_type=jnp.float32)
            + jax.lax.dot_general(qr, kr, dims, precision=precision, preferred_element_type=jnp.float32)
        ) * scale
        visible = kpos[None, :] <= qpos[:, None]
        m_new = jnp.maximum(m, jnp.where(visible, s, MASK_VALUE).max(axis=-1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        pv = jax.lax.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return m_new, l, acc * correction[:, None] + pv

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, dv), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _expanded_span(start, qpos, kpos, qn, qr, k, kr, v, *, scale, block_rows, block_keys, interpret, num_warps):
    """The Pallas flash kernel over one span: qn [b, h, T, dn], qr [b, h, T, r], qpos [b, T]
    (T a multiple of block_rows), k [b, h, S, dn], kr [b, S, r], v [b, h, S, dv], kpos [b, S].
    Returns (acc [b, h, T, dv], m [b, h, T], l [b, h, T]), float32."""
    b, h, t, dn = qn.shape
    r, span, dv = qr.shape[-1], k.shape[2], v.shape[-1]
    kernel = functools.partial(
        _expanded_kernel,
        block_keys=block_keys,
        scale=float(scale),
        precision=jax.lax.Precision.HIGHEST if k.dtype == jnp.float32 else None,
    )
    q_spec = lambda d: pl.BlockSpec((None, None, block_rows, d), lambda i, j, n: (i, n, j, 0))  # noqa: E731
    kv_spec = lambda d: pl.BlockSpec((None, None, span, d), lambda i, j, n: (i, n, 0, 0))  # noqa: E731
    stat = pl.BlockSpec((None, None, block_rows), lambda i, j, n: (i, n, j))
    return pl.pallas_call(
        kernel,
        grid=(b, t // block_rows, h),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, n: (0,)),  # the span's first position
            pl.BlockSpec((None, block_rows), lambda i, j, n: (i, j)),  # the block's query positions
            pl.BlockSpec((None, span), lambda i, j, n: (i, 0)),  # the span's key positions
            q_spec(dn),
            q_spec(r),
            kv_spec(dn),
            pl.BlockSpec((None, span, r), lambda i, j, n: (i, 0, 0)),  # the shared rope key
            kv_spec(dv),
        ],
        out_specs=[q_spec(dv), stat, stat],
        out_shape=[
            jax.ShapeDtypeStruct((b, h, t, dv), jnp.float32),
            jax.ShapeDtypeStruct((b, h, t), jnp.float32),
            jax.ShapeDtypeStruct((b, h, t), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        name="jfire_mla_expanded_prefill",
    )(jnp.reshape(start, (1,)).astype(jnp.int32), qpos, kpos, qn, qr, k, kr, v)


@functools.partial(
    jax.jit, static_argnames=("scale", "span_pages", "block_rows", "block_keys", "interpret", "num_warps")
)
def mla_expanded_prefill(
    q_nope,
    q_rope,
    w_kv_b,
    cache,
    layer,
    page_table,
    positions,
    *,
    scale: float,
    first_page=0,
    span_pages: int = 128,
    block_rows: int = 64,
    block_keys: int = 64,
    interpret: bool = False,
    num_warps: int = 4,
):
    """Prefill MLA in the expanded form: per-head keys cat(latent W_UK, rope_key) and values
    latent W_UV, built from the paged latent cache once per step, then multi-head flash
    attention with head widths dn + r (scores) and dv (values).

    q_nope [b, t, h, dn] (the query before W_UK is folded in), q_rope [b, t, h, r] at
    positions [b, t] (-1 = padding); w_kv_b [c, h, dn + dv] (kv_b_proj: W_UK then W_UV);
    cache, layer, page_table, first_page as `mla_partial_reference`. Returns the partial
    (acc [b, t, h, dv], m [b, t, h], l [b, t, h]), float32, in the *value* space: it equals
    `mla_partial_reference`'s partial with W_UV applied to acc (linear, so `combine_partials`
    over devices commutes with it), and the caller skips its W_UV.

    The context is expanded a span of `span_pages` pages at a time (a loop only as far as
    the longest row's last position), so the expanded keys and values never exceed
    [b, h, span, dn + dv] however long the page table; each span's attention is a Pallas
    flash kernel (grid (row, block of `block_rows` queries, head), keys `block_keys` at a
    time, the blocking of jfire.kernels.paged_attention's prefill kernel, returning a
    partial), and the spans' partials merge exactly. Pages not held here expand to zeros
    and are masked. The defaults are unmeasured guesses; tune them on the GPU.
    """
    b, t, h, dn = q_nope.shape
    r = q_rope.shape[-1]
    c = w_kv_b.shape[0]
    dv = w_kv_b.shape[-1] - dn
    num_local, page_size, width = cache.shape[1:]
    if width != c + r:
        raise ValueError(f"cache entries hold {width} values, the weights and queries {c} + {r}")
    dtype = jnp.result_type(q_nope.dtype, q_rope.dtype, cache.dtype)
    w = page_table.shape[1]
    span_pages = max(1, min(span_pages, w))
    span = span_pages * page_size
    block_keys = min(block_keys, span)
    if span % block_keys:
        raise ValueError(f"a span of {span} positions is not a multiple of block_keys ({block_keys})")
    table = pad_to_multiple(page_table.astype(jnp.int32), span_pages)
    block_rows = min(block_rows, max(16, 1 << (t - 1).bit_length()))
    pad = -t % block_rows
    positions = positions.astype(jnp.int32)
    qpos = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-1)
    to_rows = lambda x: jnp.pad(x.astype(dtype), ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # noqa: E731
    qn, qr = to_rows(q_nope), to_rows(q_rope)
    w_uk, w_uv = w_kv_b[..., :dn].astype(dtype), w_kv_b[..., dn:].astype(dtype)
    never = jnp.iinfo(jnp.int32).max

    def body(j, carry):
        ids, held = local_pages(
            jax.lax.dynamic_slice_in_dim(table, j * span_pages, span_pages, axis=1), first_page, num_local
        )
        held = jnp.repeat(held, page_size, axis=1)  # [b, span]
        kv = jnp.where(held[..., None], cache[layer, ids].reshape(b, span, width), 0).astype(dtype)
        latent, rope_key = kv[..., :c], kv[..., c:]
        k = jnp.einsum("bsc,chd->bhsd", latent, w_uk, preferred_element_type=jnp.float32).astype(dtype)
        v = jnp.einsum("bsc,chd->bhsd", latent, w_uv, preferred_element_type=jnp.float32).astype(dtype)
        start = j * span
        kpos = jnp.where(held, start + jnp.arange(span, dtype=jnp.int32)[None, :], never)
        part = _expanded_span(start, qpos, kpos, qn, qr, k, rope_key, v, scale=scale, block_rows=block_rows,
                              block_keys=block_keys, interpret=interpret, num_warps=num_warps)  # fmt: skip
        return merge_partials(carry, part)

    init = (
        jnp.zeros((b, h, t + pad, dv), jnp.float32),
        jnp.full((b, h, t + pad), MASK_VALUE, jnp.float32),
        jnp.zeros((b, h, t + pad), jnp.float32),
    )
    init = vary_as(init, q_nope, q_rope, cache, table, positions)
    stop = jnp.minimum((jnp.max(positions) + span) // span, table.shape[1] // span_pages)
    acc, m, l = jax.lax.fori_loop(0, stop, body, init)
    return acc[:, :, :t].transpose(0, 2, 1, 3), m[:, :, :t].transpose(0, 2, 1), l[:, :, :t].transpose(0, 2, 1)
