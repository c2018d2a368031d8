"""MLA over the paged latent cache: the Pallas decode kernel (interpret mode) against the jnp
reference, sequence-sharded partials merged against the unsharded result, the absorbed form
against plain per-head attention, and the kernel's CUDA lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.kernels.mla_attention import (
    combine_partials,
    mla_expanded_prefill,
    mla_paged_decode,
    mla_paged_prefill,
    mla_partial_reference,
)

LAYERS, LATENT, ROPE, PAGE, WIDTH = 3, 32, 16, 4, 8  # WIDTH: pages per row
LENGTHS = [0, 1, PAGE, 13, WIDTH * PAGE, 2 * PAGE + 1]  # empty, one token, a page boundary, full width


def make_case(seed, lengths, heads, spare=4, dtype=jnp.float32):
    """A random pool (random everywhere, so stray reads show) and page tables drawn from a
    random permutation of it: each row's pages out of order and interleaved with others'."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    num_pages = b * WIDTH + spare
    cache = rng.standard_normal((LAYERS, num_pages, PAGE, LATENT + ROPE)).astype(np.float32)
    table = rng.permutation(num_pages)[: b * WIDTH].reshape(b, WIDTH).astype(np.int32)
    q_latent = rng.standard_normal((b, heads, LATENT)).astype(np.float32)
    q_rope = rng.standard_normal((b, heads, ROPE)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q_latent), cast(q_rope), cast(cache), jnp.asarray(table), jnp.asarray(lengths, jnp.int32)


@functools.partial(jax.jit, static_argnums=6, static_argnames="pages_per_block")
def reference(q_latent, q_rope, cache, layer, table, lengths, scale, first_page=0, pages_per_block=None):
    """mla_partial_reference for one query a row at position length - 1."""
    acc, m, l = mla_partial_reference(q_latent[:, None], q_rope[:, None], cache, layer, table, (lengths - 1)[:, None],
                                      scale=scale, first_page=first_page, pages_per_block=pages_per_block)
    return acc[:, 0], m[:, 0], l[:, 0]


def assert_partials_close(got, want, tol=1e-5):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def merge(partials):
    """combine_partials' cross-device merge, in numpy: partials [(acc, m, l)] -> output."""
    m = np.stack([np.asarray(p[1]) for p in partials])
    top = m.max(axis=0)
    correction = np.exp(m - top)
    acc = sum(np.asarray(p[0]) * c[..., None] for p, c in zip(partials, correction))
    l = sum(np.asarray(p[2]) * c for p, c in zip(partials, correction))
    return acc / np.maximum(l, 1e-30)[..., None]


@pytest.mark.parametrize("heads,pages_per_block,heads_per_block", [(5, 1, 16), (4, 3, 16), (20, 2, 16)])
def test_kernel_equals_reference(heads, pages_per_block, heads_per_block):
    """Ragged lengths, shuffled pages, a traced nonzero layer; pages_per_block 3 does not divide
    the width (the table is padded), 20 heads are two blocks of 16."""
    q_latent, q_rope, cache, table, lengths = make_case(0, LENGTHS, heads)
    scale = 0.2
    run = functools.partial(mla_paged_decode, scale=scale, pages_per_block=pages_per_block,
                            heads_per_block=heads_per_block, interpret=True)
    for layer in (2, 1):
        got = run(q_latent, q_rope, cache, jnp.int32(layer), table, lengths)
        want = reference(q_latent, q_rope, cache, layer, table, lengths, scale)
        assert got[0].shape == (len(LENGTHS), heads, LATENT) and got[1].shape == got[2].shape == (len(LENGTHS), heads)
        assert all(x.dtype == jnp.float32 for x in got)
        assert_partials_close(got, want)
    assert float(got[2][0].max()) == 0.0 and float(jnp.abs(got[0][0]).max()) == 0.0  # the empty row sees nothing


def test_kernel_bfloat16():
    q_latent, q_rope, cache, table, lengths = make_case(1, [7, 30, 0], 5, dtype=jnp.bfloat16)
    got = mla_paged_decode(q_latent, q_rope, cache, jnp.int32(1), table, lengths, scale=0.2, interpret=True)
    want = reference(q_latent, q_rope, cache, 1, table, lengths, 0.2)
    out, ref_out = combine_partials(*got), combine_partials(*want)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("devices", [2, 4])
def test_sequence_sharded_partials_combine_to_unsharded(devices):
    """The pool split into contiguous ranges of page ids, one per device: each device's kernel
    partial equals its reference partial, and merging them gives the unsharded output."""
    heads, scale, layer = 5, 0.3, 2
    q_latent, q_rope, cache, table, lengths = make_case(2, LENGTHS, heads, spare=0)
    num_pages = cache.shape[1]
    assert num_pages % devices == 0
    per = num_pages // devices
    whole = reference(q_latent, q_rope, cache, layer, table, lengths, scale)
    want = np.asarray(combine_partials(*whole))
    np.testing.assert_allclose(np.asarray(combine_partials(*mla_paged_decode(
        q_latent, q_rope, cache, jnp.int32(layer), table, lengths, scale=scale, pages_per_block=2, interpret=True))),
        want, rtol=1e-5, atol=1e-5)
    kernel_parts, reference_parts = [], []
    for d in range(devices):
        local = cache[:, d * per:(d + 1) * per]
        first = jnp.int32(d * per)  # traced, as under a shard_map
        got = mla_paged_decode(q_latent, q_rope, local, jnp.int32(layer), table, lengths, scale=scale,
                               first_page=first, pages_per_block=2, interpret=True)
        ref = reference(q_latent, q_rope, local, layer, table, lengths, scale, first_page=first)
        assert_partials_close(got, ref)
        kernel_parts.append(got)
        reference_parts.append(ref)
    np.testing.assert_allclose(merge(kernel_parts), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(merge(reference_parts), want, rtol=1e-5, atol=1e-5)


def test_absorbed_equals_expanded_attention():
    """Folding W_UK into the query and applying W_UV after attention over the latent equals
    attention with per-head keys cat(latent W_UK, rope_key) and values latent W_UV: the
    kernel, and the reference looping over one block or over blocks of 1 and 3 pages (an
    online softmax across blocks; 3 does not divide the table)."""
    rng = np.random.default_rng(3)
    heads, dn, dv, scale, layer = 5, 24, 20, 0.15, 1
    lengths = [11, 1, WIDTH * PAGE]
    b = len(lengths)
    num_pages = b * WIDTH + 2
    w_uk = rng.standard_normal((LATENT, heads, dn)) / np.sqrt(LATENT)
    w_uv = rng.standard_normal((LATENT, heads, dv)) / np.sqrt(LATENT)
    latent = rng.standard_normal((b, WIDTH * PAGE, LATENT))  # per row, per token
    rope_key = rng.standard_normal((b, WIDTH * PAGE, ROPE))
    q_nope = rng.standard_normal((b, heads, dn))
    q_rope = rng.standard_normal((b, heads, ROPE))
    table = rng.permutation(num_pages)[: b * WIDTH].reshape(b, WIDTH).astype(np.int32)
    cache = rng.standard_normal((LAYERS, num_pages, PAGE, LATENT + ROPE))
    for row in range(b):
        for pos in range(WIDTH * PAGE):
            cache[layer, table[row, pos // PAGE], pos % PAGE] = np.concatenate([latent[row, pos], rope_key[row, pos]])

    expanded = np.zeros((b, heads, dv))
    for row, n in enumerate(lengths):
        for h in range(heads):
            k = np.concatenate([latent[row, :n] @ w_uk[:, h], rope_key[row, :n]], axis=-1)  # [n, dn + r]
            v = latent[row, :n] @ w_uv[:, h]  # [n, dv]
            s = k @ np.concatenate([q_nope[row, h], q_rope[row, h]]) * scale
            p = np.exp(s - s.max())
            expanded[row, h] = (p / p.sum()) @ v

    f32 = lambda x: jnp.asarray(x, jnp.float32)
    q_latent = jnp.einsum("bhd,chd->bhc", f32(q_nope), f32(w_uk), precision="highest")
    args = (q_latent, f32(q_rope), f32(cache), jnp.int32(layer), jnp.asarray(table), jnp.asarray(lengths, jnp.int32))
    partials = [reference(*args, scale, pages_per_block=n) for n in (None, 1, 3)]
    for partial in (*partials, mla_paged_decode(*args, scale=scale, interpret=True)):
        out = jnp.einsum("bhc,chv->bhv", combine_partials(*partial), f32(w_uv), precision="highest")
        np.testing.assert_allclose(np.asarray(out), expanded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [64, 128, 8])  # Kimi K2, DeepSeek-V3, a tensor-parallel shard
def test_kernel_exports_for_cuda(heads):
    """The GPU path lowers on this CPU-only machine: jax.export for platforms=['cuda'], with the
    layer and first_page traced."""
    s = jax.ShapeDtypeStruct
    args = (s((4, heads, 512), jnp.bfloat16), s((4, heads, 64), jnp.bfloat16), s((61, 256, 16, 576), jnp.bfloat16),
            s((), jnp.int32), s((4, 64), jnp.int32), s((4,), jnp.int32), s((), jnp.int32))

    def decode(q_latent, q_rope, cache, layer, table, lengths, first_page):
        return mla_paged_decode(q_latent, q_rope, cache, layer, table, lengths, scale=0.07, first_page=first_page)

    exported = jax.export.export(
        jax.jit(decode), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",)
    assert "__gpu$xla.gpu.triton" in text and "jfire_mla_paged_decode" in text
    assert [o.shape for o in exported.out_avals] == [(4, heads, 512), (4, heads), (4, heads)]


def prefill_case(seed, rows, heads, dtype=jnp.float32):
    """Queries [b, t, h, *] of chunks after cached prefixes: rows (prefix, new tokens), padded
    with -1 to the longest chunk; the pool and table of make_case."""
    _, _, cache, table, _ = make_case(seed, [0] * len(rows), heads, dtype=dtype)
    rng = np.random.default_rng(seed + 100)
    t = max(1, max(new for _, new in rows))
    positions = np.full((len(rows), t), -1, np.int32)
    for r, (prefix, new) in enumerate(rows):
        positions[r, :new] = np.arange(prefix, prefix + new)
    q_latent = jnp.asarray(rng.standard_normal((len(rows), t, heads, LATENT)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((len(rows), t, heads, ROPE)), dtype)
    return q_latent, q_rope, cache, table, jnp.asarray(positions)


# (cached prefix, new tokens): from 0, mid-page after a prefix, none (padding), to the full width.
PREFILL_ROWS = [(0, 5), (13, 6), (9, 0), (WIDTH * PAGE - 7, 7)]


@pytest.mark.parametrize("heads,block_rows,pages_per_block", [(5, 16, 1), (4, 32, 3), (2, 16, 2)])
def test_prefill_kernel_equals_reference(heads, block_rows, pages_per_block):
    """The prefill kernel's partials equal the reference's for ragged chunks after cached
    prefixes (a row of padding included), several blocks of query rows and of pages, and
    with the pool split over two devices (first_page traced): each device's partial, and
    the merge equal to the unsharded output."""
    q_latent, q_rope, cache, table, positions = prefill_case(4, PREFILL_ROWS, heads)
    run = functools.partial(mla_paged_prefill, scale=0.2, block_rows=block_rows, pages_per_block=pages_per_block,
                            interpret=True)  # fmt: skip
    got = run(q_latent, q_rope, cache, jnp.int32(2), table, positions)
    want = mla_partial_reference(q_latent, q_rope, cache, 2, table, positions, scale=0.2)
    assert got[0].shape == q_latent.shape and got[1].shape == got[2].shape == q_latent.shape[:3]
    assert_partials_close(got, want)
    assert float(jnp.abs(got[0][2]).max()) == 0.0 and float(got[2][2].max()) == 0.0  # padding sees nothing
    per = cache.shape[1] // 2
    parts = []
    for d in range(2):
        local = cache[:, d * per : (d + 1) * per]
        part = run(q_latent, q_rope, local, jnp.int32(2), table, positions, first_page=jnp.int32(d * per))
        assert_partials_close(part, mla_partial_reference(q_latent, q_rope, local, 2, table, positions, scale=0.2,
                                                          first_page=d * per))  # fmt: skip
        parts.append(part)
    valid = np.asarray(positions) >= 0
    np.testing.assert_allclose(merge(parts)[valid], np.asarray(combine_partials(*want))[valid], rtol=1e-5, atol=1e-5)


def test_prefill_kernel_bfloat16():
    """bf16 queries and cache on both sides; each rounds its probabilities to bf16 before the
    value product against its own running max (the blocks differ): to bf16's precision."""
    q_latent, q_rope, cache, table, positions = prefill_case(5, PREFILL_ROWS, 4, dtype=jnp.bfloat16)
    got = mla_paged_prefill(q_latent, q_rope, cache, jnp.int32(1), table, positions, scale=0.2, interpret=True)
    want = mla_partial_reference(q_latent, q_rope, cache, 1, table, positions, scale=0.2)
    np.testing.assert_allclose(np.asarray(combine_partials(*got)), np.asarray(combine_partials(*want)),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


def test_prefill_kernel_exports_for_cuda():
    """DeepSeek-V3's shapes (128 heads, 512 + 64) lower for CUDA, layer and first_page traced."""
    s = jax.ShapeDtypeStruct
    args = (s((2, 16, 128, 512), jnp.bfloat16), s((2, 16, 128, 64), jnp.bfloat16),
            s((61, 256, 16, 576), jnp.bfloat16), s((), jnp.int32), s((2, 64), jnp.int32), s((2, 16), jnp.int32),
            s((), jnp.int32))  # fmt: skip

    def prefill(q_latent, q_rope, cache, layer, table, positions, first_page):
        return mla_paged_prefill(q_latent, q_rope, cache, layer, table, positions, scale=0.07, first_page=first_page)

    exported = jax.export.export(
        jax.jit(prefill), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)  # fmt: skip
    assert "jfire_mla_paged_prefill" in exported.mlir_module()
    assert [o.shape for o in exported.out_avals] == [(2, 16, 128, 512), (2, 16, 128), (2, 16, 128)]


# -- the expanded form (long prefill chunks) ---------------------------------------------------

DN, DV = 16, 16


def expanded_case(seed, heads, dtype=jnp.float32):
    """prefill_case's chunks with q_nope [b, t, h, dn] and kv_b_proj [c, h, dn + dv]; q_latent
    = q_nope W_UK (float32, exact) for the absorbed reference."""
    _, q_rope, cache, table, positions = prefill_case(seed, PREFILL_ROWS, heads, dtype=dtype)
    rng = np.random.default_rng(seed + 200)
    q_nope = jnp.asarray(rng.standard_normal((*positions.shape, heads, DN)), dtype)
    wkv_b = jnp.asarray(rng.standard_normal((LATENT, heads, DN + DV)) / np.sqrt(LATENT), dtype)
    q_latent = jnp.einsum("bthd,chd->bthc", q_nope.astype(jnp.float32), wkv_b[..., :DN].astype(jnp.float32),
                          precision="highest").astype(dtype)  # fmt: skip
    return q_nope, q_latent, q_rope, wkv_b, cache, table, positions


def absorbed_output(partial, wkv_b):
    """The absorbed form's output per head in the value space: combine, then W_UV."""
    return jnp.einsum("bthc,chv->bthv", combine_partials(*partial), wkv_b[..., DN:].astype(jnp.float32),
                      precision="highest")  # fmt: skip


@pytest.mark.parametrize("heads,span_pages,block_keys", [(5, 1, 4), (4, 3, 4), (2, 64, 16)])
def test_expanded_prefill_equals_absorbed(heads, span_pages, block_keys):
    """The expanded form (keys and values built from the latent, flash attention over spans of
    pages) equals the absorbed reference with W_UV applied, for ragged chunks after cached
    prefixes (a row of padding, which sees nothing), one or several spans; and with the pool
    split over two devices (first_page traced) each device's partial is the absorbed one's
    times W_UV (acc) and the same (m, l), and the merge equals the unsharded output."""
    q_nope, q_latent, q_rope, wkv_b, cache, table, positions = expanded_case(6, heads)
    run = functools.partial(mla_expanded_prefill, scale=0.2, span_pages=span_pages, block_keys=block_keys,
                            block_rows=16, interpret=True)  # fmt: skip
    valid = np.asarray(positions) >= 0
    got = run(q_nope, q_rope, wkv_b, cache, jnp.int32(2), table, positions)
    assert got[0].shape == (*positions.shape, heads, DV) and got[1].shape == got[2].shape == q_nope.shape[:3]
    want = mla_partial_reference(q_latent, q_rope, cache, 2, table, positions, scale=0.2)
    np.testing.assert_allclose(np.asarray(combine_partials(*got))[valid], np.asarray(absorbed_output(want, wkv_b))[valid],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert float(jnp.abs(got[0][2]).max()) == 0.0 and float(got[2][2].max()) == 0.0  # padding sees nothing
    per = cache.shape[1] // 2
    parts = []
    for d in range(2):
        local = cache[:, d * per : (d + 1) * per]
        part = run(q_nope, q_rope, wkv_b, local, jnp.int32(2), table, positions, first_page=jnp.int32(d * per))
        acc, m, l = mla_partial_reference(q_latent, q_rope, local, 2, table, positions, scale=0.2, first_page=d * per)
        acc = jnp.einsum("bthc,chv->bthv", acc, wkv_b[..., DN:], precision="highest")
        assert_partials_close(tuple(x[valid] for x in part), (acc[valid], m[valid], l[valid]))
        parts.append(part)
    np.testing.assert_allclose(merge(parts)[valid], np.asarray(absorbed_output(want, wkv_b))[valid],
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_expanded_prefill_bfloat16():
    """bf16 queries, weights and cache: the expanded form rounds its keys and values (latent
    W_UK, latent W_UV) and its probabilities to bf16, the absorbed reference its probabilities
    and its output before W_UV: different roundings of the same sums, so agreement to bf16's
    precision (8 bits: a few 1e-3 relative per rounding, summed over the context)."""
    q_nope, q_latent, q_rope, wkv_b, cache, table, positions = expanded_case(7, 4, dtype=jnp.bfloat16)
    got = mla_expanded_prefill(q_nope, q_rope, wkv_b, cache, jnp.int32(1), table, positions, scale=0.2,
                               span_pages=2, block_keys=8, interpret=True)  # fmt: skip
    want = mla_partial_reference(q_latent, q_rope, cache, 1, table, positions, scale=0.2)
    valid = np.asarray(positions) >= 0
    np.testing.assert_allclose(np.asarray(combine_partials(*got))[valid], np.asarray(absorbed_output(want, wkv_b))[valid],
                               rtol=3e-2, atol=3e-2)  # fmt: skip


V3 = dict(heads=128, latent=512, rope=64, nope=128, v=128)  # DeepSeek-V3 and Kimi K2 (64 heads: same rule)


def test_prefill_form_rule():
    """The FLOP rule: expanded above c (dn + dv) / (2c - dn - dv) = 170.7 tokens at any prefix;
    below, absorbed once the prefix is long (and expanded while it is short); one token absorbed."""
    from jfire.kernels.mla_attention import mla_prefill_flops, mla_prefill_form

    assert mla_prefill_form(1, 0, **V3) == "absorbed"
    for cached in (0, 1000, 128 * 1024):
        assert mla_prefill_form(171, cached, **V3) == mla_prefill_form(4096, cached, **V3) == "expanded"
    assert mla_prefill_form(170, 128 * 1024, **V3) == mla_prefill_form(16, 4096, **V3) == "absorbed"
    assert mla_prefill_form(16, 0, **V3) == "expanded"  # no context to expand beyond the chunk's own
    assert mla_prefill_form(64, 4096, **{**V3, "heads": 64}) == "absorbed"
    # the hand count at 512 tokens after 4,096: 2·128·(1088·pairs + 512·512·256) against 2·128·(320·pairs + 4608·512·256)
    pairs = 512 * 4096 + 512 * 513 // 2
    flops = mla_prefill_flops(512, 4096, **V3)
    assert flops == {"absorbed": 256 * (1088 * pairs + 512 * 512 * 256), "expanded": 256 * (320 * pairs + 4608 * 512 * 256)}


def test_model_picks_the_form_by_length():
    """jfire.models.mla.prefill_expanded: the expanded form only with the engine's kernels
    (not the reference attention), never for decode, and for long chunks at DeepSeek-V3's widths."""
    from types import SimpleNamespace

    from jfire.models.mla import prefill_expanded
    from jfire.programs import PallasAttention

    cfg = SimpleNamespace(num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    pallas = PallasAttention(interpret=True)
    assert prefill_expanded(cfg, pallas, 512, 128 * 1024) and prefill_expanded(cfg, pallas, 171, 128 * 1024)
    assert not prefill_expanded(cfg, pallas, 128, 128 * 1024) and not prefill_expanded(cfg, pallas, 1, 64)
    assert not prefill_expanded(cfg, None, 512, 128 * 1024)


def test_expanded_prefill_exports_for_cuda():
    """DeepSeek-V3's shapes (128 heads, latent 512 + rope 64, dn = dv = 128) lower for CUDA:
    a 256-token chunk, a 1,024-page table (16k positions), layer and first_page traced."""
    s = jax.ShapeDtypeStruct
    args = (s((1, 256, 128, 128), jnp.bfloat16), s((1, 256, 128, 64), jnp.bfloat16), s((512, 128, 256), jnp.bfloat16),
            s((61, 1024, 16, 576), jnp.bfloat16), s((), jnp.int32), s((1, 1024), jnp.int32), s((1, 256), jnp.int32),
            s((), jnp.int32))  # fmt: skip

    def prefill(q_nope, q_rope, wkv_b, cache, layer, table, positions, first_page):
        return mla_expanded_prefill(q_nope, q_rope, wkv_b, cache, layer, table, positions, scale=0.07,
                                    first_page=first_page)  # fmt: skip

    exported = jax.export.export(
        jax.jit(prefill), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)  # fmt: skip
    assert "jfire_mla_expanded_prefill" in exported.mlir_module()
    assert [o.shape for o in exported.out_avals] == [(1, 256, 128, 128), (1, 256, 128), (1, 256, 128)]
