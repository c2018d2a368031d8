"""The CPU decode attention kernel (jfire.kernels.cpu_attention) against the reference paged
attention: scattered pages, several rows of different lengths, padding, a sliding window,
contexts over several segments, a layer picked from the stack; the same bits for a row alone
or batched; and a clear error for a page table that names a page outside the pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.kernels import cpu_attention, cpu_matmul
from jfire.kernels.paged_attention import paged_attention_reference

LAYERS, KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM = 3, 2, 320, 16, 64


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_matmul.available(), "the CPU kernels did not build (see the warning above)"


def case(lengths, t=1, heads=6, seed=0, head_dim=HEAD_DIM, page_size=PAGE_SIZE):
    """Pages filled with noise, each row's pages a random permutation of the pool, the query
    tokens at the rows' last t positions (a length of 0 makes a padding row)."""
    rng = np.random.default_rng(seed)
    shape = (LAYERS, KV_HEADS, PAGES, page_size, head_dim)
    k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    width = PAGES // len(lengths)
    table = rng.permutation(PAGES)[:width * len(lengths)].reshape(len(lengths), width).astype(np.int32)
    positions = np.array([[n - t + i if n else -1 for i in range(t)] for n in lengths], np.int32)
    q = rng.standard_normal((len(lengths), t, heads, head_dim), dtype=np.float32)
    return q, k, v, table, positions


def both(q, k, v, table, positions, layer, sliding_window=None):
    def run(q, k, v, table, positions, layer):
        with cpu_matmul.in_place(True):
            return cpu_attention.paged_attention(q, k, v, layer, table, positions, sliding_window=sliding_window)

    got = jax.jit(run)(q, k, v, table, positions, jnp.int32(layer))
    want = jax.jit(lambda *a: paged_attention_reference(*a[:3], a[5], a[3], a[4], sliding_window=sliding_window))(
        q, k, v, table, positions, jnp.int32(layer))
    return np.asarray(got), np.asarray(want)


def test_the_kernel_is_what_the_programs_trace(kernel_build):
    q, k, v, table, positions = case([5])
    with cpu_matmul.in_place(True):
        text = jax.jit(lambda *a: cpu_attention.paged_attention(*a[:3], 0, *a[3:])).lower(q, k, v, table, positions).as_text()
    assert cpu_matmul.target("jfire_paged_attention") in text  # this build's


@pytest.mark.parametrize("lengths,window", [([1], None), ([600], None), ([17, 300, 1, 0, 513], None),
                                            ([700, 40, 256, 257], 100), ([1000], 300)])
def test_matches_the_reference(lengths, window, kernel_build):
    q, k, v, table, positions = case(lengths)
    for layer in (0, 2):
        got, want = both(q, k, v, table, positions, layer, window)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert not np.any(got[np.asarray(lengths) == 0]), "a padding row gets zeros"


@pytest.mark.parametrize("head_dim,page_size", [(128, 16), (64, 8), (64, 32), (48, 16)])
def test_other_head_sizes_and_pages(head_dim, page_size, kernel_build):
    """Head sizes of 4 and 8 vectors have their own score loops, others the general one; pages
    shorter and longer than the score loop's blocks of keys."""
    q, k, v, table, positions = case([300, 37, 1], head_dim=head_dim, page_size=page_size)
    got, want = both(q, k, v, table, positions, 1)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_a_few_query_tokens_per_row_are_causal(kernel_build):
    q, k, v, table, positions = case([300, 20], t=3)
    got, want = both(q, k, v, table, positions, 1)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_a_row_gives_the_same_bits_alone_or_batched(kernel_build):
    q, k, v, table, positions = case([600, 30, 333])
    batched, _ = both(q, k, v, table, positions, 1)
    for r in range(3):
        alone, _ = both(q[r:r + 1], k, v, table[r:r + 1], positions[r:r + 1], 1)
        np.testing.assert_array_equal(alone[0], batched[r])


@pytest.mark.parametrize("window", [None, 100])
def test_a_rows_tokens_as_decode_rows_give_each_tokens_bits_alone(window, kernel_build):
    """A verify step's k + 1 tokens a row (`decode_rows`, which runs a row's tokens that read the
    same keys one after another): each token's output is the bits of that token attending as a
    one-token row of its own, over one and several 256-position segments, beside a padding row
    and a row whose last positions are padding."""
    t = 9
    q, k, v, table, positions = case([700, 250, 0, 40], t=t)
    positions[3, 6:] = -1  # a row with fewer drafts than the step's width

    def rows(q, k, v, table, positions):
        with cpu_matmul.in_place(True):
            return cpu_attention.decode_rows(q, k, v, jnp.int32(1), table, positions, sliding_window=window)

    def one_token_rows(q, k, v, table, positions):
        b = q.shape[0]
        with cpu_matmul.in_place(True):
            out = cpu_attention.paged_attention(
                q.reshape(b * t, 1, *q.shape[2:]), k, v, jnp.int32(1), jnp.repeat(table, t, axis=0),
                positions.reshape(b * t, 1), sliding_window=window,
            )
        return out.reshape(q.shape)

    together = np.asarray(jax.jit(rows)(q, k, v, table, positions))
    alone = np.asarray(jax.jit(one_token_rows)(q, k, v, table, positions))
    np.testing.assert_array_equal(together, alone)
    _, want = both(q.reshape(-1, 1, *q.shape[2:]), k, v, np.repeat(table, t, axis=0), positions.reshape(-1, 1), 1, window)
    np.testing.assert_allclose(together.reshape(want.shape), want, rtol=2e-5, atol=2e-6)


def test_a_page_outside_the_pool_is_an_error(kernel_build):
    q, k, v, table, positions = case([40])
    table[0, 1] = PAGES + 5
    with pytest.raises(Exception, match="names a page outside the pool"):
        both(q, k, v, table, positions, 0)
