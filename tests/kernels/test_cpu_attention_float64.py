"""The CPU decode attention kernel (jfire.kernels.cpu_attention) at long contexts against a
float64 numpy reference written here, independent of jfire's float32 JAX reference: each row's
keys and values gathered through its page table up to its position (from the window's start
with a sliding window), softmax and weighted sum in float64. Contexts of up to 2,048 positions
run over up to eight of the kernel's 256-position segments and its merge of their partial
softmaxes.

The bound (`error_bound`) is a worst-case rounding analysis of the kernel's float32 arithmetic,
u = 2^-24 the unit roundoff and gamma(k) = k u / (1 - k u) the bound on k roundings in a row
(Higham, "Accuracy and Stability of Numerical Algorithms", 3.1). For one query head, keys
j = lo..p with exact scores s_j, weights w_j = softmax(s)_j and values v_j:

- a score is a dot product of d terms times a float32 scale (itself 1/sqrt(d) rounded): in any
  order of summation, FMA or not, |error| <= gamma(d + 2) a_j, where a_j = scale sum_e |q_e k_je|;
  with A = max_j a_j, every |s_j| <= A;
- the exponent's argument is shifted twice (s_j - segment max inside a segment, segment max -
  overall max in the merge), each difference at most 2A in size: 4 u A more;
- the exponentials: the kernel's Cephes expf inside a segment (peak relative error about
  1.7e-7, 3 u, on its reduced range, plus the rounding of its argument reduction) and std::exp
  in the merge (under 1 ulp): 6 u together;
  so each unnormalised weight has relative error at most eta = gamma(d + 2) A + 4 u A + 6 u, and
  normalising by their sum at most doubles it: sum_j w_j |v_j| 2 eta / (1 - eta);
- the sums: within a segment up to 256 terms (fused multiply-adds), then a product by the
  segment's factor and at most S additions in the merge (S segments): gamma(257 + S) relative to
  sum_j w_j |v_j| for the weighted values and again for the denominator; the final product by
  1 / l: 2 u.

Together, elementwise, |kernel - exact| <= rel / (1 - rel) * sum_j w_j |v_je| with
rel = 2 eta + 2 gamma(257 + S) + 2 u (the first-order terms; dividing by 1 - rel covers the
higher-order ones). The weights the kernel clamps below exp(-87) would add at most
n e^-87 ~ 1e-34 relative: nothing here (the scores span a few tens). At d = 64 and these
scores rel is 0.5e-4 to 3e-4. The bound holds whatever order the kernel sums in (16 lanes with
AVX-512, 8 with AVX2, the scalar loop), and it is still tight enough to see a single key
too many or too few among 2,048 (`test_one_key_more_or_fewer_breaks_the_bound`): a wrong page,
position, window or merge weight fails it, rounding cannot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.kernels import cpu_attention, cpu_matmul

U = 2.0**-24  # float32's unit roundoff
SEGMENT = 256  # the kernel's positions per unit of work (kSegment in cpu_attention.cc)
LAYERS, KV_HEADS, HEADS, PAGE_SIZE = 2, 2, 4, 16
LONGEST = 2048


def gamma(k):
    return k * U / (1 - k * U)


def case(lengths, t, head_dim, seed):
    """Pages of noise for len(lengths) rows of up to LONGEST positions, each row's pages
    scattered over the pool by a random permutation; the query tokens at each row's last t
    positions. The query heads are scaled 0.5, 1, 2, 3 so some softmaxes are flat and some
    peaked."""
    rng = np.random.default_rng(seed)
    width = LONGEST // PAGE_SIZE
    pages = width * len(lengths) + 7
    shape = (LAYERS, KV_HEADS, pages, PAGE_SIZE, head_dim)
    k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    table = rng.permutation(pages)[: width * len(lengths)].reshape(len(lengths), width).astype(np.int32)
    positions = np.array([[n - t + i for i in range(t)] for n in lengths], np.int32)
    q = rng.standard_normal((len(lengths), t, HEADS, head_dim), dtype=np.float32)
    q *= np.array([0.5, 1.0, 2.0, 3.0], np.float32)[:, None]
    return q, k, v, table, positions


def kernel(q, k, v, table, positions, layer, sliding_window):
    def run(q, k, v, table, positions, layer):
        with cpu_matmul.in_place(True):
            assert cpu_attention.applies(q, k), "the kernel would not run: this would test the reference"
            return cpu_attention.paged_attention(q, k, v, layer, table, positions, sliding_window=sliding_window)

    return np.asarray(jax.jit(run)(q, k, v, table, positions, jnp.int32(layer)))


def float64_attention(q, k, v, table, positions, layer, sliding_window):
    """(out [b, t, h, d], the bound on the kernel's error [b, t, h, d]) in float64."""
    b, t, h, d = q.shape
    g = h // k.shape[1]
    out, bound = np.zeros((b, t, h, d)), np.zeros((b, t, h, d))
    scale = 1.0 / np.sqrt(d)
    for row in range(b):
        for token in range(t):
            p = int(positions[row, token])
            lo = max(0, p - sliding_window + 1) if sliding_window else 0
            slots = np.arange(lo, p + 1)
            pages, offsets = table[row, slots // PAGE_SIZE], slots % PAGE_SIZE
            segments = p // SEGMENT - lo // SEGMENT + 1
            for head in range(h):
                keys = k[layer, head // g, pages, offsets].astype(np.float64)  # [n, d]
                values = v[layer, head // g, pages, offsets].astype(np.float64)
                qh = q[row, token, head].astype(np.float64)
                s = keys @ qh * scale
                w = np.exp(s - s.max())
                w /= w.sum()
                out[row, token, head] = w @ values
                bound[row, token, head] = error_bound(qh, keys, values, w, segments)
    return out, bound


def error_bound(q, keys, values, weights, segments):
    """The module docstring's bound on |kernel - exact| [d] for one query head q [d] over keys
    and values [n, d] (float64) with exact softmax weights [n], the keys over `segments`
    segments."""
    d = q.shape[-1]
    big_a = (np.abs(keys) @ np.abs(q)).max() / np.sqrt(d)
    eta = gamma(d + 2) * big_a + 4 * U * big_a + 6 * U
    rel = 2 * eta + 2 * gamma(SEGMENT + 1 + segments) + 2 * U
    return rel / (1 - rel) * (weights @ np.abs(values))


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_matmul.available(), "the CPU kernels did not build (see the warning above)"


@pytest.mark.parametrize("head_dim", [64, 24], ids=["vector-loops", "scalar-loops"])
@pytest.mark.parametrize(
    "lengths,t,window",
    [([300, 1000, LONGEST], 1, None), ([LONGEST, 1500, 700], 2, 700)],
    ids=["full", "sliding-window"],
)
def test_matches_float64_within_the_rounding_bound(lengths, t, window, head_dim, kernel_build):
    """Rows of 300, 1,000 and 2,048 positions (2 to 8 segments); a window of 700 that starts
    inside a segment, two query tokens per row. Head size 64 runs the kernel's vector loops
    (4 or 8 vectors a head), 24 its general ones."""
    q, k, v, table, positions = case(lengths, t, head_dim, seed=head_dim + t)
    got = kernel(q, k, v, table, positions, 1, window)
    want, bound = float64_attention(q, k, v, table, positions, 1, window)
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), (
        f"at {worst}: |kernel - float64| = {err[worst]:.3g} > bound {bound[worst]:.3g} (max error {err.max():.3g})"
    )


def test_one_key_more_or_fewer_breaks_the_bound(kernel_build):
    """The bound is no blanket: the float64 reference over one key fewer (the first of the
    2,048-position row, or of a window) or one more than the kernel attends to lies outside it."""
    q, k, v, table, positions = case([300, 1000, LONGEST], 1, 64, seed=65)
    got = kernel(q, k, v, table, positions, 1, None)
    want, bound = float64_attention(q, k, v, table, positions, 1, LONGEST - 1)
    assert np.all(np.abs(got - want)[:2] <= bound[:2]), "rows under 2,047 positions do not change"
    assert np.any(np.abs(got - want)[2] > bound[2])
    q, k, v, table, positions = case([LONGEST, 1500, 700], 2, 64, seed=66)
    got = kernel(q, k, v, table, positions, 1, 700)
    for window in (699, 701):
        want, bound = float64_attention(q, k, v, table, positions, 1, window)
        assert np.any(np.abs(got - want) > bound), window
