"""The routed experts' grouped matmul (jfire.kernels.grouped_matmul) in interpret mode against XLA's
ragged_dot (bf16 / f32 weights), the dequantized layer (FP8) and a per-group float64 matmul; its
schedule (no tile for an expert without rows); the models' choice of it; and its CUDA lowering.
The kernel inside the expert-parallel shard_map is checked by CUDA export (tests/test_cuda_export.py):
JAX 0.10.2's Pallas interpreter fails there."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfire.kernels import grouped_matmul as gm
from jfire.kernels.int4_experts import use_impl
from jfire.models import fp8_experts, moe

TRITON = "__gpu$xla.gpu.triton"
# Shapes no tile divides: in 200 (64-input steps, the last one ragged), out 80 (32-column tiles).
N_IN, N_OUT, ROWS = 200, 80, 24
TILES = gm.Tiles(rows=16, out=32, inner=64)
# Uneven groups over 6 experts: empty ones first, middle and last, one spanning two row tiles and
# rows past the total; every row on one expert; a single row; nothing routed at all.
SIZES = [[0, 3, 0, 17, 1, 0], [0, 0, 0, 0, ROWS, 0], [0, 0, 1, 0, 0, 0], [0] * 6]


def per_group_matmul(xs, w_in_out, sizes):
    """Expert g's rows times its [in, out] weights in float64; rows past the total stay zero."""
    out = np.zeros((xs.shape[0], w_in_out.shape[2]))
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = np.asarray(xs[start : start + n], np.float64) @ np.asarray(w_in_out[g], np.float64)
        start += n
    return out


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def fp8_layer(rng, experts, out, n_in):
    """FP8 codes [E, out, in] (finite, every exponent) and positive block scales, as released."""
    codes = (rng.standard_normal((experts, out, n_in)) * 2.0 ** rng.integers(-6, 6, (experts, out, n_in)))
    codes = np.clip(codes, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (experts, -(-out // 128), -(-n_in // 128))) * 2.0 ** -6
    return jnp.asarray(codes), jnp.asarray(scale.astype(np.float32))


@pytest.mark.parametrize("sizes", SIZES)
def test_equals_ragged_dot_and_per_group_matmul(sizes):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((ROWS, N_IN)).astype(np.float32)
    w = rng.standard_normal((len(sizes), N_IN, N_OUT)).astype(np.float32)
    args = jnp.asarray(xs), jnp.asarray(w), jnp.asarray(sizes, jnp.int32)
    got = np.asarray(gm.grouped_matmul(*args, interpret=True, tiles=TILES))
    assert got.shape == (ROWS, N_OUT) and got.dtype == np.float32
    assert np.all(got[sum(sizes) :] == 0)
    assert rel(got, gm.grouped_matmul_reference(*args)) < 1e-6
    assert rel(got, per_group_matmul(xs, w, sizes)) < 1e-6


def test_experts_without_rows_are_never_read():
    """Their weights all NaN: nothing of them reaches the result (a read would, through the dot)."""
    rng = np.random.default_rng(1)
    sizes = SIZES[0]
    xs = rng.standard_normal((ROWS, N_IN)).astype(np.float32)
    w = rng.standard_normal((len(sizes), N_IN, N_OUT)).astype(np.float32)
    poisoned = np.where(np.asarray(sizes)[:, None, None] == 0, np.nan, w).astype(np.float32)
    got = np.asarray(gm.grouped_matmul(jnp.asarray(xs), jnp.asarray(poisoned), jnp.asarray(sizes, jnp.int32),
                                       interpret=True, tiles=TILES))  # fmt: skip
    assert np.all(np.isfinite(got))
    assert rel(got, per_group_matmul(xs, w, sizes)) < 1e-6


@pytest.mark.parametrize("sizes,a", [([0, 3, 0, 17, 1, 0], 24), ([5, 0, 0, 0, 0, 40], 50), ([0] * 6, 4), ([0, 1], 1)])
def test_schedule_tiles_each_experts_rows_once_and_no_empty_expert(sizes, a):
    """The ragged schedule: live tiles (a tile takes rows [first, min(first + block_rows, end)),
    end its expert's end) cover each expert's rows exactly once, name no expert without rows,
    and fit the grid's bound."""
    rows = 16
    bound = -(-a // rows) + min(len(sizes), a)
    expert, first, end = (np.asarray(v) for v in gm._row_tiles(jnp.asarray(sizes, jnp.int32), a, rows, bound))
    live = first < end
    assert set(expert[live].tolist()) == {g for g, n in enumerate(sizes) if n}
    owner = np.full(a, -1)
    for g, lo, hi in zip(expert[live], first[live], np.minimum(first + rows, end)[live]):
        assert np.all(owner[lo:hi] == -1)  # no row twice
        owner[lo:hi] = g
    assert owner.tolist() == [g for g, n in enumerate(sizes) for _ in range(n)] + [-1] * (a - sum(sizes))


def test_split_inputs_and_bfloat16_rows():
    """The input axis split in two (decode's partial sums) and bf16 rows and weights: the tensor-core
    dot's inputs, float32 accumulation, as XLA's ragged_dot."""
    rng = np.random.default_rng(2)
    sizes = jnp.asarray([9, 0, 2, 11], jnp.int32)
    xs = jnp.asarray(rng.standard_normal((ROWS, N_IN)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, N_IN, N_OUT)), jnp.bfloat16)
    split = gm.Tiles(rows=16, out=32, inner=64, k_splits=2)
    got = np.asarray(gm.grouped_matmul(xs, w, sizes, interpret=True, tiles=split))
    want = np.asarray(gm.grouped_matmul_reference(xs, w, sizes))
    assert rel(got, want) < 1e-5
    assert rel(want, per_group_matmul(np.asarray(xs, np.float32), np.asarray(w, np.float32), [9, 0, 2, 11])) < 1e-5


def test_decode_row_with_chosen_tiles():
    """One token (batch-1 decode, top-1) with the tiles `choose_tiles` picks for it."""
    rng = np.random.default_rng(3)
    xs = jnp.asarray(rng.standard_normal((1, 96)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 96, 48)), jnp.float32)
    sizes = jnp.asarray([0, 0, 0, 0, 0, 1, 0, 0], jnp.int32)
    got = gm.grouped_matmul(xs, w, sizes, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(xs @ w[5]), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fp8_equals_the_dequantized_layer(dtype):
    """FP8 codes [E, out, in] in partial 128 x 128 scale blocks (out 160, in 200), tiles that
    divide neither, rows in the compute dtype: each tile dequantized as `fp8_experts.dequantize`
    rounds the whole layer, so the kernel equals ragged_dot over that layer."""
    rng = np.random.default_rng(4)
    sizes = jnp.asarray([0, 3, 0, 17, 1, 0], jnp.int32)
    codes, scale = fp8_layer(rng, 6, 160, N_IN)
    xs = jnp.asarray(rng.standard_normal((ROWS, N_IN)), dtype)
    got = np.asarray(gm.grouped_matmul_fp8(xs, codes, scale, sizes, interpret=True, tiles=TILES))
    want = np.asarray(gm.grouped_matmul_fp8_reference(xs, codes, scale, sizes))
    assert got.shape == (ROWS, 160) and np.all(got[21:] == 0)
    assert rel(got, want) < (1e-6 if dtype == jnp.float32 else 1e-5)
    w = np.asarray(fp8_experts.dequantize(codes, scale, jnp.float32))  # [E, in, out]
    # The reference itself against float64: bf16 rounds the dequantized weights (2**-9 relative).
    assert rel(want, per_group_matmul(np.asarray(xs, np.float32), w, [0, 3, 0, 17, 1, 0])) < (
        1e-6 if dtype == jnp.float32 else 1e-2
    )


def test_tiles_are_chosen_by_rows_per_expert():
    decode = gm.choose_tiles(1, 16, 5120, 8192)  # Scout, batch 1, top-1
    assert decode.rows == 16 and decode.out <= 64
    prefill = gm.choose_tiles(4096, 16, 5120, 8192)  # 256 rows an expert
    assert prefill.rows == 128 and prefill.out == 128 and prefill.k_splits == 1
    with pytest.raises(ValueError, match="power of two"):
        gm.Tiles(rows=24)
    with pytest.raises(ValueError, match="scale block"):
        gm.grouped_matmul_fp8(jnp.zeros((4, 256)), *fp8_layer(np.random.default_rng(5), 2, 256, 256),
                              jnp.asarray([2, 2], jnp.int32), tiles=gm.Tiles(out=256))  # fmt: skip


def test_models_take_the_kernel_under_pallas_and_xla_elsewhere():
    """`jfire.models.moe` routes bf16 experts through the kernel when the impl is "pallas" (a GPU's
    default) and keeps XLA's ragged_dot on the CPU and under `use_impl("xla")`; the interpreted
    kernel gives the dense all-experts result."""
    rng = np.random.default_rng(6)
    t, e, f, experts = 5, 32, 48, 4
    x = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
    weights, chosen = moe.route(jnp.asarray(rng.standard_normal((t, experts)), jnp.float32), moe.Router("softmax_topk", 2))
    w = [jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32) for shape in [(experts, e, f)] * 2 + [(experts, f, e)]]
    layer = jax.jit(lambda *a: moe.experts_dropless(*a, scale_input=False))
    with use_impl("pallas-interpret"):
        got = layer(x, weights, chosen, *w)
    want = moe.experts_dense_reference(x, weights, chosen, *w, scale_input=False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    def lowered(impl):
        with use_impl(impl):
            return layer.trace(x, weights, chosen, *w).lower(lowering_platforms=("cuda",)).as_text()

    assert "jfire_grouped_matmul" in lowered("pallas") and "chlo.ragged_dot" not in lowered("pallas")
    assert "chlo.ragged_dot" in lowered("xla") and TRITON not in lowered("xla")
    # No impl set, on this CPU: XLA's ragged_dot (which jax lowers there as a dense emulation).
    on_cpu = layer.lower(x, weights, chosen, *w).as_text()
    assert "jfire_grouped_matmul" not in on_cpu and "custom_call" not in on_cpu


@pytest.mark.parametrize("rows", [1, 4096], ids=["decode", "prefill"])
def test_kernels_export_for_cuda_at_scout_and_deepseek_shapes(rows):
    """bf16 at Llama 4 Scout's expert shapes (hidden 5120, width 8192, 16 experts), FP8 at
    DeepSeek-V3's (7168 <-> 2048, as bytes too) with fewer experts: jax.export for 'cuda'."""
    s = jax.ShapeDtypeStruct
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]
    for n_in, out in [(5120, 8192), (8192, 5120)]:
        args = s((rows, n_in), jnp.bfloat16), s((16, n_in, out), jnp.bfloat16), s((16,), jnp.int32)
        exported = jax.export.export(gm.grouped_matmul, platforms=["cuda"], disabled_checks=checks)(*args)
        assert "jfire_grouped_matmul" in exported.mlir_module()
        assert exported.out_avals[0].shape == (rows, out) and exported.out_avals[0].dtype == jnp.float32
    for n_in, out, code in [(7168, 2048, jnp.float8_e4m3fn), (2048, 7168, jnp.uint8)]:
        args = (s((rows * 8, n_in), jnp.bfloat16), s((32, out, n_in), code), s((32, out // 128, n_in // 128), jnp.float32),
                s((32,), jnp.int32))  # fmt: skip
        exported = jax.export.export(gm.grouped_matmul_fp8, platforms=["cuda"], disabled_checks=checks)(*args)
        text = exported.mlir_module()
        assert "jfire_grouped_matmul_fp8" in text and TRITON in text
        assert exported.in_avals[1].dtype == code  # the codes enter as bytes, never a dequantized layer
