"""Packed int4 expert weights: the packer and unpacker against compressed-tensors' format written
out element by element, the device dequantizer against the numpy unpacker, and the grouped
matmul (XLA and the Pallas kernel in interpret mode) against ragged_dot and a per-group numpy
matmul."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfire.kernels.int4_experts import dequantize, pack_int4, ragged_dot_int4, unpack_int4_np

BF16 = ml_dtypes.bfloat16


def random_packed(rng, shape_out_in):
    """Arbitrary words (every nibble pattern) and positive bf16 scales."""
    *lead, out, n_in = shape_out_in
    packed = rng.integers(-(1 << 31), 1 << 31, (*lead, out, n_in // 8), dtype=np.int64).astype(np.int32)
    scale = (rng.uniform(0.5, 2.0, (*lead, out, n_in // 32)) * 2.0 ** rng.integers(-8, 2, (*lead, out, n_in // 32)))
    return packed, scale.astype(BF16)


def test_pack_follows_compressed_tensors_element_by_element():
    """compressed-tensors' symmetric int4 (scale = bf16(max|w| / 7.5), zero scale -> bf16 eps,
    q = round-half-even(clamp(w / scale, -8, 7))), stored as q + 8 in nibble i % 8 of word i // 8."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w[0, 1, 32:] = 0.0  # an all-zero group
    w[1, 2, :32] = np.linspace(-3.0, 3.0, 32)  # both ends of the range, exactly at +-7.5 scales
    packed, scale = pack_int4(w)
    assert packed.dtype == np.int32 and packed.shape == (2, 3, 8)
    assert scale.dtype == BF16 and scale.shape == (2, 3, 2)
    eps = float(ml_dtypes.finfo(BF16).eps)
    for e in range(2):
        for o in range(3):
            words = [0] * 8
            for g in range(2):
                amax = max(abs(float(v)) for v in w[e, o, 32 * g: 32 * g + 32])
                s = float(BF16(np.float32(amax) / np.float32(7.5))) or eps
                assert float(scale[e, o, g]) == s
                for i in range(32 * g, 32 * g + 32):
                    q = round(min(max(float(np.float32(w[e, o, i]) / np.float32(s)), -8.0), 7.0))
                    words[i // 8] |= (q + 8) << (4 * (i % 8))
            assert packed[e, o].view(np.uint32).tolist() == words


def test_unpack_reference_element_by_element():
    rng = np.random.default_rng(1)
    packed, scale = random_packed(rng, (2, 3, 64))
    got = unpack_int4_np(packed, scale)
    assert got.dtype == np.float32 and got.shape == (2, 3, 64)
    for e in range(2):
        for o in range(3):
            for i in range(64):
                nibble = (int(packed[e, o, i // 8].view(np.uint32)) >> (4 * (i % 8))) & 0xF
                assert got[e, o, i] == (nibble - 8) * float(scale[e, o, i // 32])


def test_values_on_the_grid_pack_back_bit_exactly():
    rng = np.random.default_rng(2)
    packed, scale = random_packed(rng, (3, 16, 128))
    again, same_scale = pack_int4(unpack_int4_np(packed, scale), scale=scale)
    assert np.array_equal(again, packed)
    assert np.array_equal(same_scale.view(np.uint16), scale.view(np.uint16))


def test_round_trip_error_is_half_a_step():
    """Rounding to the nearest code: at most half a scale off, a little more only where the
    group's largest value (7.5 steps, scale rounded to bf16) is clamped to code 7."""
    w = np.random.default_rng(3).standard_normal((4, 8, 256)).astype(np.float32)
    packed, scale = pack_int4(w)
    step = np.repeat(scale.astype(np.float32), 32, axis=-1)
    err = np.abs(unpack_int4_np(packed, scale) - w)
    assert np.all(err <= 0.5 * step * (1 + 2.0 ** -4))
    assert np.mean(err <= 0.5 * step) > 0.99


@pytest.mark.parametrize("lead", [(), (3,)])
def test_dequantize_is_reference_transposed(lead):
    packed, scale = random_packed(np.random.default_rng(4), (*lead, 24, 96))
    want = np.swapaxes(unpack_int4_np(packed, scale), -1, -2)  # [..., in, out]
    got = dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.float32)
    assert got.shape == (*lead, 96, 24) and got.dtype == jnp.float32
    assert np.array_equal(np.asarray(got), want)
    got16 = dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.bfloat16)
    assert np.array_equal(np.asarray(got16).view(np.uint16), want.astype(BF16).view(np.uint16))


def per_group_matmul(xs, packed, scale, sizes):
    """Expert g's rows times its weights, in float64; rows past the total stay zero."""
    w = unpack_int4_np(packed, scale).astype(np.float64)  # [X, out, in]
    out = np.zeros((xs.shape[0], w.shape[1]))
    start = 0
    for g, n in enumerate(sizes):
        out[start:start + n] = xs[start:start + n].astype(np.float64) @ w[g].T
        start += n
    return out


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


# Uneven groups: empty ones first, middle and last; one spanning two 16-row blocks; rows past
# the total (padding); a single row; nothing routed at all.
CASES = [([0, 3, 0, 17, 1, 0], 24), ([5, 0, 0, 0, 0, 19], 24), ([0, 0, 1, 0, 0, 0], 1), ([0] * 6, 4)]


@pytest.mark.parametrize("impl", ["xla", "pallas-interpret"])
@pytest.mark.parametrize("sizes,a", CASES)
def test_ragged_dot_int4_equals_ragged_dot_and_per_group_matmul(impl, sizes, a):
    rng = np.random.default_rng(5)
    packed, scale = random_packed(rng, (6, 128, 256))
    xs = rng.standard_normal((a, 256)).astype(np.float32)
    args = jnp.asarray(xs), jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(sizes, jnp.int32)
    got = np.asarray(ragged_dot_int4(*args, impl=impl))  # out 2 tiles of 64, in 2 steps of 128
    w = dequantize(args[1], args[2], jnp.float32)
    via_xla = np.asarray(jax.lax.ragged_dot(args[0], w, args[3], preferred_element_type=jnp.float32))
    want = per_group_matmul(xs, packed, scale, sizes)
    assert got.shape == (a, 128) and got.dtype == np.float32
    assert np.all(got[sum(sizes):] == 0)
    assert rel(got, via_xla) < 1e-6
    assert rel(got, want) < 1e-6


def test_pallas_bfloat16_activations_equal_xla():
    """bf16 rows: both paths round the weights to bf16 and accumulate in float32."""
    rng = np.random.default_rng(6)
    sizes = [2, 0, 9, 4]
    packed, scale = random_packed(rng, (4, 64, 128))
    xs = jnp.asarray(rng.standard_normal((16, 128)), jnp.bfloat16)
    args = xs, jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(sizes, jnp.int32)
    xla = np.asarray(ragged_dot_int4(*args, impl="xla"))
    pallas = np.asarray(ragged_dot_int4(*args, impl="pallas-interpret", block_out=32, block_in=64))
    assert rel(pallas, xla.astype(np.float64)) < 1e-5
    assert rel(xla, per_group_matmul(np.asarray(xs, np.float32), packed, scale, sizes)) < 1e-2


def test_pallas_refuses_tiles_that_do_not_divide():
    packed, scale = random_packed(np.random.default_rng(7), (2, 96, 64))
    with pytest.raises(ValueError, match="block_out"):
        ragged_dot_int4(jnp.zeros((4, 64)), jnp.asarray(packed), jnp.asarray(scale), jnp.asarray([2, 2], jnp.int32),
                        impl="pallas-interpret", block_out=64)


def test_pallas_kernel_exports_for_cuda():
    """The GPU path lowers on this CPU-only machine: jax.export for platforms=['cuda'], at Kimi
    K2.5's routed-expert shapes (hidden 7168, expert width 2048) with fewer experts."""
    s = jax.ShapeDtypeStruct
    triton = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for (n_in, out) in [(7168, 2048), (2048, 7168)]:
        args = (s((64, n_in), jnp.bfloat16), s((48, out, n_in // 8), jnp.int32), s((48, out, n_in // 32), jnp.bfloat16),
                s((48,), jnp.int32))
        exported = jax.export.export(jax.jit(functools.partial(ragged_dot_int4, impl="pallas")), platforms=["cuda"],
                                     disabled_checks=triton)(*args)
        text = exported.mlir_module()
        assert exported.platforms == ("cuda",)
        assert "__gpu$xla.gpu.triton" in text and "jfire_ragged_dot_int4" in text
        assert exported.out_avals[0].shape == (64, out) and exported.out_avals[0].dtype == jnp.float32
