"""Paged attention (the jnp reference and the Pallas kernel in interpret mode) against plain
contiguous attention, on random inputs with ragged lengths and shuffled page tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.kernels.paged_attention import attention, paged_attention, paged_attention_reference

LAYERS, KV_HEADS, GROUP, HEAD_DIM, PAGE, PAGES_PER_ROW = 2, 2, 3, 32, 4, 8


def make_case(seed, lengths, dtype=jnp.float32):
    """Contiguous K/V per row, and the same values scattered over a shuffled page pool."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    num_pages = b * PAGES_PER_ROW + 3
    k = rng.standard_normal((LAYERS, b, PAGES_PER_ROW * PAGE, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    table = rng.permutation(num_pages)[: b * PAGES_PER_ROW].reshape(b, PAGES_PER_ROW).astype(np.int32)
    k_pages = rng.standard_normal((LAYERS, KV_HEADS, num_pages, PAGE, HEAD_DIM)).astype(np.float32)  # garbage elsewhere
    v_pages = rng.standard_normal(k_pages.shape).astype(np.float32)
    for row in range(b):
        for slot in range(PAGES_PER_ROW * PAGE):
            page, off = table[row, slot // PAGE], slot % PAGE
            k_pages[:, :, page, off] = k[:, row, slot]
            v_pages[:, :, page, off] = v[:, row, slot]
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(k), cast(v), cast(k_pages), cast(v_pages), jnp.asarray(table)


def rel(a, b):
    return float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))


@pytest.mark.parametrize("window", [None, 5])
def test_reference_prefill_chunk_equals_contiguous(window):
    lengths = [3, 17, 32, 9]
    k, v, k_pages, v_pages, table = make_case(0, lengths)
    rng = np.random.default_rng(1)
    t = 6
    q = jnp.asarray(rng.standard_normal((len(lengths), t, KV_HEADS * GROUP, HEAD_DIM)), jnp.float32)
    # Each row's chunk ends at its length; rows shorter than the chunk are padded with -1.
    positions = np.array([[p if p >= 0 else -1 for p in range(n - t, n)] for n in lengths], np.int32)
    for layer in range(LAYERS):
        want = attention(q, k[layer], v[layer], jnp.asarray(positions), window)
        got = paged_attention_reference(q, k_pages, v_pages, layer, table, jnp.asarray(positions), window)
        valid = positions >= 0
        assert rel(got[valid], want[valid]) < 1e-6


@pytest.mark.parametrize("pages_per_block", [1, 3])
@pytest.mark.parametrize("window,chunk", [(None, None), (6, None), (None, 8)])
def test_reference_block_loop_equals_contiguous(pages_per_block, window, chunk):
    """The reference's loop over blocks of pages (an online softmax across blocks; 3 pages do
    not divide the table, which is padded): prefill chunks and decode rows of ragged lengths,
    and long rows only, where the first block any query sees is past block 0 (a window or a
    chunk), against contiguous attention."""
    rng = np.random.default_rng(6)
    for lengths, t in (([3, 17, 32, 9], 6), ([30, 25, 32], 1), ([31, 28], 3)):
        k, v, k_pages, v_pages, table = make_case(7, lengths)
        q = jnp.asarray(rng.standard_normal((len(lengths), t, KV_HEADS * GROUP, HEAD_DIM)), jnp.float32)
        positions = jnp.asarray([[p if p >= 0 else -1 for p in range(n - t, n)] for n in lengths], jnp.int32)
        valid = positions >= 0
        for layer in range(LAYERS):
            want = attention(q, k[layer], v[layer], positions, window, chunk)
            got = paged_attention_reference(q, k_pages, v_pages, layer, table, positions, window, chunk,
                                            pages_per_block=pages_per_block)
            assert rel(got[valid], want[valid]) < 1e-6


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("pages_per_block", [1, 4])
def test_pallas_decode_kernel_equals_contiguous(window, pages_per_block):
    lengths = [1, 5, 32, 13, 20]
    k, v, k_pages, v_pages, table = make_case(2, lengths)
    q = jnp.asarray(np.random.default_rng(3).standard_normal((len(lengths), KV_HEADS * GROUP, HEAD_DIM)), jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    positions = (lens - 1)[:, None]
    for layer in range(LAYERS):
        want = attention(q[:, None], k[layer], v[layer], positions, window)[:, 0]
        ref = paged_attention_reference(q[:, None], k_pages, v_pages, layer, table, positions, window)[:, 0]
        got = paged_attention(q, k_pages, v_pages, jnp.int32(layer), table, lens, sliding_window=window,
                              pages_per_block=pages_per_block, interpret=True)
        assert rel(ref, want) < 1e-6
        assert rel(got, want) < 1e-5


def test_pallas_decode_kernel_bfloat16():
    lengths = [7, 30]
    k, v, k_pages, v_pages, table = make_case(4, lengths, jnp.bfloat16)
    q = jnp.asarray(np.random.default_rng(5).standard_normal((2, KV_HEADS * GROUP, HEAD_DIM)), jnp.bfloat16)
    lens = jnp.asarray(lengths, jnp.int32)
    want = attention(q[:, None], k[1], v[1], (lens - 1)[:, None])[:, 0]
    got = paged_attention(q, k_pages, v_pages, jnp.int32(1), table, lens, interpret=True)
    assert rel(got, want) < 2e-2  # bf16 output rounding (8 bits of mantissa)


def test_pallas_decode_kernel_exports_for_cuda():
    """The GPU path lowers on this CPU-only machine: jax.export for platforms=['cuda']."""
    import functools

    s = jax.ShapeDtypeStruct
    args = (s((4, 9, 64), jnp.bfloat16), s((30, 3, 256, 16, 64), jnp.bfloat16), s((30, 3, 256, 16, 64), jnp.bfloat16),
            s((), jnp.int32), s((4, 64), jnp.int32), s((4,), jnp.int32))
    exported = jax.export.export(
        jax.jit(functools.partial(paged_attention, pages_per_block=8)),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",)
    assert "__gpu$xla.gpu.triton" in text and "jfire_paged_decode_attention" in text
