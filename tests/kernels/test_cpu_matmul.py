"""The CPU matmul kernels (jfire.kernels.cpu_matmul) against float64 numpy products: odd and
real shapes, every row count up to the kernels' limit, the layer picked from a stack inside a
jitted layer scan; and that the engine's programs really call them where they apply."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.kernels import cpu_matmul


@pytest.fixture(scope="module", autouse=True)
def kernels():
    # setup.sh builds them; a machine where they cannot be built must not pass this silently.
    assert cpu_matmul.available(), "the CPU matmul kernels did not build (see the warning above)"


def within_float32_rounding(got, x, w):
    """got equals x @ w computed in float64, to float32 accumulation error: at most a few ulps
    of the sum of |x| |w| over the contraction, at every element."""
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    bound = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
    err = np.abs(np.asarray(got, np.float64) - want)
    k = x.shape[-1]
    assert got.shape == want.shape
    assert np.all(err <= 4 * np.sqrt(k) * np.finfo(np.float32).eps * bound + 1e-30), float((err / (bound + 1e-30)).max())


SHAPES = [(1, 576, 1536), (1, 1536, 576), (3, 5, 7), (8, 1027, 192), (17, 576, 960), (64, 64, 2048), (2, 130, 33)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_stacked_matmul_picks_the_layer_and_multiplies(m, k, n, kernel_build):
    rng = np.random.default_rng(m * 1000 + k)
    stack = rng.standard_normal((3, k, n), dtype=np.float32)
    x = rng.standard_normal((m, k), dtype=np.float32)
    f = jax.jit(cpu_matmul.stacked_matmul)
    for layer in range(3):
        within_float32_rounding(np.asarray(f(x, stack, jnp.int32(layer))), x, stack[layer])


@pytest.mark.parametrize("m,k", [(1, 576), (2, 130), (7, 576), (64, 64)])
def test_stacked_matmuls_give_each_stacks_product_and_the_lone_calls_bits(m, k, kernel_build):
    """One call over several stacks of different widths (a layer's q, k and v) gives each
    stack's float64 product, and the same bits as multiplying by each stack alone."""
    rng = np.random.default_rng(m + k)
    stacks = [rng.standard_normal((3, k, n), dtype=np.float32) for n in (576, 192, 33)]
    x = rng.standard_normal((m, k), dtype=np.float32)
    grouped, alone = jax.jit(cpu_matmul.stacked_matmuls), jax.jit(cpu_matmul.stacked_matmul)
    for layer in range(3):
        outs = grouped(x, stacks, jnp.int32(layer))
        assert len(outs) == len(stacks)
        for got, stack in zip(outs, stacks):
            within_float32_rounding(np.asarray(got), x, stack[layer])
            np.testing.assert_array_equal(np.asarray(got), np.asarray(alone(x, stack, jnp.int32(layer))))


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matmul_nt_is_x_times_w_transposed(m, k, n, kernel_build):
    rng = np.random.default_rng(m * 1000 + n)
    w = rng.standard_normal((n, k), dtype=np.float32)
    x = rng.standard_normal((2, m, k), dtype=np.float32)  # leading dims are kept
    got = np.asarray(jax.jit(cpu_matmul.matmul_nt)(x, w))
    within_float32_rounding(got.reshape(-1, n), x.reshape(-1, k), w.T)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_bfloat16_weights_give_the_float32_kernels_bits_on_the_widened_weights(m, k, n, kernel_build):
    """A bfloat16 weight (stack or head) is widened exactly and summed in the float32 order:
    the product equals the float32 kernel's on the same values held as float32, bit for bit,
    in one call with float32 stacks beside it too."""
    rng = np.random.default_rng(m * 7 + n)
    stack16 = jnp.asarray(rng.standard_normal((2, k, n), dtype=np.float32), jnp.bfloat16)
    stack32 = stack16.astype(jnp.float32)
    other = rng.standard_normal((2, k, 40), dtype=np.float32)
    x = rng.standard_normal((m, k), dtype=np.float32)
    grouped = jax.jit(cpu_matmul.stacked_matmuls)
    for layer in range(2):
        got16, got_other = grouped(x, [stack16, other], jnp.int32(layer))
        want32, want_other = grouped(x, [stack32, other], jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(got16), np.asarray(want32))
        np.testing.assert_array_equal(np.asarray(got_other), np.asarray(want_other))
    head16 = jnp.asarray(rng.standard_normal((n, k), dtype=np.float32), jnp.bfloat16)
    nt = jax.jit(cpu_matmul.matmul_nt)
    np.testing.assert_array_equal(np.asarray(nt(x, head16)), np.asarray(nt(x, head16.astype(jnp.float32))))


def test_stacked_matmul_inside_a_layer_scan(kernel_build):
    """A scan over 6 layers that multiplies by each layer's weight from the whole stack gives
    the layer-by-layer float64 products."""
    rng = np.random.default_rng(0)
    stack = rng.standard_normal((6, 96, 96), dtype=np.float32) / 10
    x = rng.standard_normal((4, 96), dtype=np.float32)

    def run(x, stack):
        return jax.lax.scan(lambda h, j: (jnp.tanh(cpu_matmul.stacked_matmul(h, stack, j)),) * 2, x,
                            jnp.arange(6, dtype=jnp.int32))[1]

    steps = np.asarray(jax.jit(run)(x, stack))
    h = x
    for j in range(6):
        want = np.tanh(np.asarray(h, np.float64) @ stack[j].astype(np.float64))
        np.testing.assert_allclose(steps[j], want, rtol=0, atol=1e-5)
        h = steps[j]


def test_the_engine_programs_call_the_kernels_only_where_they_apply(default_checkpoint):
    """A float32 decode program with cpu_matmul=True calls the kernels (every layer product,
    the tied head, the decode attention); the same program without it, and a prefill of more
    rows than the kernels take, call none."""
    from jfire.checkpoint.load import load_model
    from jfire.kv_cache import init_pages
    from jfire.programs import decode, prefill
    from jfire.sampling import init_penalty_state, neutral_rows

    model = load_model("default", "float32")
    cfg, params = model.config, model.params
    pages = init_pages(cfg, 8, 16, jnp.float32)
    pen = init_penalty_state(2, cfg.vocab_size)
    i32 = np.int32

    def decode_text(flag):
        return decode.lower(params, pages, np.zeros(1, i32), np.zeros(1, i32), np.zeros((1, 8), i32),
                            neutral_rows(1, cfg.vocab_size), pen, cfg=cfg, cpu_matmul=flag).as_text()

    on, off = decode_text(True), decode_text(False)
    kernels = ("jfire_stacked_matmul", "jfire_matmul_nt", "jfire_paged_attention")
    assert all(name in on for name in kernels)
    assert not any(name in off for name in kernels)
    t = cpu_matmul.MAX_ROWS * 2
    big = prefill.lower(params, pages, np.zeros((1, t), i32), np.zeros((1, t), i32), np.zeros((1, 8), i32),
                        np.zeros(1, i32), neutral_rows(1, cfg.vocab_size), pen, np.full((1, t), -1, i32),
                        cfg=cfg, cpu_matmul=True).as_text()
    assert "jfire_stacked_matmul" not in big and "jfire_paged_attention" not in big  # (its head: one row)


@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (130, 70)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(k, n, kernel_build):
    """Every path (register panels of any row count, the columns left over, the nt blocks)
    sums in the same order, bit for bit: a sequence decodes the same alone or batched."""
    rng = np.random.default_rng(k + n)
    stack = rng.standard_normal((2, k, n), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    x = rng.standard_normal((cpu_matmul.MAX_ROWS, k), dtype=np.float32)
    stacked, nt = jax.jit(cpu_matmul.stacked_matmul), jax.jit(cpu_matmul.matmul_nt)
    all_stacked, all_nt = np.asarray(stacked(x, stack, jnp.int32(1))), np.asarray(nt(x, w))
    for m in (1, 2, 3, 5, 6, 7, 13, 16, 33):
        np.testing.assert_array_equal(np.asarray(stacked(x[:m], stack, jnp.int32(1))), all_stacked[:m])
        np.testing.assert_array_equal(np.asarray(nt(x[:m], w)), all_nt[:m])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k,n", [(576, 200), (100, 77), (1536, 49)])
def test_every_row_count_up_to_40_gives_each_rows_lone_bits(dtype, k, n, kernel_build):
    """Rows 1..40 in one call (one register panel, several, the last ones short; the nt blocks
    and the rows past the last whole block) equal each row multiplied alone, bit for bit, for
    float32 and bfloat16 weights, stacked and nt, with the tails: n not a multiple of a panel's
    or a vector's columns, k not a multiple of 8 or of the dot products' step. Speculative
    decoding's verify rows must equal decode's rows exactly."""
    rng = np.random.default_rng(k * 7 + n)
    stack = jnp.asarray(rng.standard_normal((2, k, n), dtype=np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((n, k), dtype=np.float32), dtype)
    x = rng.standard_normal((40, k), dtype=np.float32)
    # Zeros and negative zeros in x: a sum must start from +0 on every path alike.
    x[3, :5] = 0.0
    x[7, :5] = -0.0
    stacked, nt = jax.jit(cpu_matmul.stacked_matmul), jax.jit(cpu_matmul.matmul_nt)
    alone_stacked = np.concatenate([np.asarray(stacked(x[r : r + 1], stack, jnp.int32(1))) for r in range(40)])
    alone_nt = np.concatenate([np.asarray(nt(x[r : r + 1], w)) for r in range(40)])
    for m in range(1, 41):
        np.testing.assert_array_equal(
            np.asarray(stacked(x[:m], stack, jnp.int32(1))), alone_stacked[:m], err_msg=f"{m} rows"
        )
        np.testing.assert_array_equal(np.asarray(nt(x[:m], w)), alone_nt[:m], err_msg=f"{m} rows, nt")
    within_float32_rounding(alone_stacked, x, np.asarray(stack[1], np.float32))
    within_float32_rounding(alone_nt, x, np.asarray(w, np.float32).T)
