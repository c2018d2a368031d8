"""Routed-expert weights kept as packed int4 on the device, and the grouped matmul that reads them.

Format (compressed-tensors `pack-quantized`, as Kimi K2.5 ships its routed experts): per expert
linear, HF layout [out, in],
  - `weight_packed` int32 [out, in/8]: eight 4-bit codes per word, least-significant nibble
    first, so input i sits in word i // 8 at bits 4 * (i % 8);
  - `weight_scale` bf16 [out, in/32]: one scale per group of 32 consecutive inputs;
  - value w[o, i] = (nibble(o, i) - 8) * scale[o, i // 32] (symmetric: no zero point).

The engine keeps expert weights in-major ([experts, in, out]); `dequantize` returns that layout.
`ragged_dot_int4` is `jax.lax.ragged_dot` over those weights without ever holding them unpacked:
its Pallas kernel unpacks one [out tile, in tile] of codes at a time inside the dot loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfire.kernels.varying import out_struct, vary_alike

GROUP = 32  # inputs per scale
NIBBLES = 8  # codes per int32 word
OFFSET = 8  # stored nibble = code + 8, codes in [-8, 7]
# compressed-tensors' symmetric scale: max|w| / ((q_max - q_min) / 2) = max|w| / 7.5, so the
# largest magnitude lands exactly between codes 7 and 8 and is clamped to 7 (or is -8).
HALF_RANGE = 7.5


# -- host side (numpy): building packed weights, and the reference unpacker --------------------


def pack_int4(w, group: int = GROUP, scale=None):
    """Quantize float w [..., out, in] as compressed-tensors does for symmetric int4.

    Returns (packed int32 [..., out, in/8], scale bf16 [..., out, in/group]). The scale is
    max|w| over the group / 7.5 rounded to bf16 (a zero scale becomes bf16's eps, as there);
    codes are round-half-even(clamp(w / scale, -8, 7)), the quotient taken in w's own dtype as
    the library takes it (a bf16 weight's quotient is rounded to bf16 before the codes are).
    Pass `scale` to quantize onto given scales instead: values already on that grid then come
    back bit for bit.
    """
    quotient_dtype = ml_dtypes.bfloat16 if np.asarray(w).dtype == ml_dtypes.bfloat16 else np.float32
    w = np.asarray(w, np.float32)
    out, n_in = w.shape[-2:]
    if n_in % group or group % NIBBLES:
        raise ValueError(f"inputs ({n_in}) must be a multiple of the group ({group}), itself a multiple of {NIBBLES}")
    grouped = w.reshape(*w.shape[:-1], n_in // group, group)
    if scale is None:
        scale = (np.abs(grouped).max(axis=-1) / HALF_RANGE).astype(ml_dtypes.bfloat16)
        scale[scale == 0] = ml_dtypes.finfo(ml_dtypes.bfloat16).eps
    scale = np.asarray(scale).astype(ml_dtypes.bfloat16)
    quotient = (grouped.astype(quotient_dtype) / scale.astype(quotient_dtype)[..., None]).astype(np.float32)
    codes = np.round(np.clip(quotient, -OFFSET, OFFSET - 1))
    nibbles = (codes.astype(np.int64) + OFFSET).reshape(*w.shape[:-1], n_in // NIBBLES, NIBBLES)
    words = (nibbles << (4 * np.arange(NIBBLES))).sum(axis=-1)  # disjoint bits: the sum is an OR
    return words.astype(np.uint32).view(np.int32), scale


def unpack_int4_np(packed, scale):
    """float32 [..., out, in] from packed [..., out, in/8] and scale [..., out, in/32].

    Reads the words as little-endian bytes (low nibble first), a route independent of the
    shift-based device unpacker below.
    """
    data = np.ascontiguousarray(np.asarray(packed, np.int32)).astype("<i4").view(np.uint8)  # [..., out, in/2]
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(*data.shape[:-1], -1).astype(np.float32) - OFFSET
    group = codes.shape[-1] // np.shape(scale)[-1]
    return codes * np.repeat(np.asarray(scale).astype(np.float32), group, axis=-1)


# -- device side (jnp) -----------------------------------------------------------------------------


def _unpack(words, scale):
    """float32 [..., rows, 8 * W] from words [..., rows, W] and scales [..., rows, G].

    Shared by `dequantize` and the kernel (there on one tile): only broadcasts, shifts and
    reshapes that merge trailing axes, which Triton lowers.
    """
    shifts = 4 * jax.lax.broadcasted_iota(jnp.int32, (1,) * words.ndim + (NIBBLES,), words.ndim)
    nibbles = jax.lax.shift_right_logical(words[..., None], shifts) & 0xF  # [..., rows, W, 8]
    n_in = words.shape[-1] * NIBBLES
    codes = (nibbles - OFFSET).astype(jnp.float32).reshape(*words.shape[:-1], n_in)
    groups = scale.shape[-1]
    scales = jnp.broadcast_to(scale.astype(jnp.float32)[..., None], (*scale.shape, n_in // groups))
    return codes * scales.reshape(*scale.shape[:-1], n_in)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(packed, scale, dtype=jnp.bfloat16):
    """Packed [..., out, in/8] + scale [..., out, in/32] -> weights [..., in, out] (in-major, the
    engine's expert layout) in `dtype`; computed in float32 and rounded once."""
    return jnp.swapaxes(_unpack(packed, scale), -1, -2).astype(dtype)


# -- the grouped matmul ----------------------------------------------------------------------------

# Which impl the models' expert matmuls (`jfire.models.moe._ragged_dot`) use: `ragged_dot_int4`'s
# impl for int4 experts, and for bf16 and FP8 ones "pallas" / "pallas-interpret" select
# jfire.kernels.grouped_matmul, "xla" XLA's ragged_dot; None: by backend (`default_impl`). Set it
# only for a block of tracing with `with use_impl("tiled"): ...`, as `jfire plan` does to measure
# on XLA:CPU the tile-sized buffers of the GPU kernel's algorithm rather than the "xla" path's
# whole unpacked layer, or with `use_impl("xla")` to keep XLA's ragged_dot on a GPU. A jax user context:
# part of jit's cache key (a program traced under one impl is never reused under another) and,
# like JAX's own config contexts, local to the thread that enters it.
_IMPL = jax.make_user_context(default_value=None)
IMPLS = ("xla", "pallas", "pallas-interpret", "tiled")


def use_impl(impl: str | None):
    """A context manager: the models' expert matmuls traced inside it use `impl` (see _IMPL)."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}: expected one of {IMPLS}")
    return _IMPL(impl)


def default_impl() -> str:
    """`use_impl`'s choice, else the Pallas kernel on a GPU and XLA's ragged_dot elsewhere."""
    return _IMPL.value or ("pallas" if jax.default_backend() == "gpu" else "xla")


def _ragged_kernel(
    start_ref, end_ref, x_ref, packed_ref, scale_ref, zeros_ref, o_ref, *, block_rows: int, block_in: int, precision
):
    """One (expert, out tile): the expert's rows, block_rows at a time, against its weights.

    x_ref [a + block_rows, in] (padded so a block starting at any row reads in bounds);
    packed_ref [tn, in/8] and scale_ref [tn, in/32] are this expert's out tile; o_ref
    [a + block_rows, tn] is the out tile of every row (it starts as zeros_ref, aliased): each
    expert stores only its own rows, so rows no expert owns stay zero.
    """
    del zeros_ref  # aliased to o_ref
    start, end = start_ref[0], end_ref[0]
    tn = o_ref.shape[1]
    words_per_step = block_in // NIBBLES
    groups_per_step = block_in // GROUP
    steps = x_ref.shape[1] // block_in
    compute = x_ref.dtype

    def row_block(b, carry):
        first = start + b * block_rows

        def in_step(k, acc):
            x = x_ref[pl.ds(first, block_rows), pl.ds(k * block_in, block_in)]  # [block_rows, block_in]
            words = packed_ref[:, pl.ds(k * words_per_step, words_per_step)]  # [tn, block_in / 8]
            scale = scale_ref[:, pl.ds(k * groups_per_step, groups_per_step)]  # [tn, block_in / 32]
            w = _unpack(words, scale).astype(compute)  # [tn, block_in]
            return acc + jax.lax.dot_general(
                x, w, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )

        acc = jax.lax.fori_loop(0, steps, in_step, jnp.zeros((block_rows, tn), jnp.float32))
        rows = first + jax.lax.broadcasted_iota(jnp.int32, (block_rows, tn), 0)
        plgpu.store(o_ref.at[pl.ds(first, block_rows), :], acc, mask=rows < end)
        return carry

    jax.lax.fori_loop(0, (end - start + block_rows - 1) // block_rows, row_block, 0)


def _ragged_dot_pallas(xs, packed, scale, sizes, *, interpret, block_rows, block_out, block_in, num_warps):
    a, n_in = xs.shape
    experts, out, _ = packed.shape
    block_out, block_in = min(block_out, out), min(block_in, n_in)
    if out % block_out or n_in % block_in or block_in % GROUP:
        raise ValueError(
            f"out ({out}) must be a multiple of block_out ({block_out}), in ({n_in}) of block_in "
            f"({block_in}), and block_in of {GROUP}"
        )
    ends = jnp.minimum(jnp.cumsum(sizes.astype(jnp.int32)), a)
    starts = jnp.minimum(ends - sizes.astype(jnp.int32), a)
    # A row block may start at any row up to a - 1: pad so it never reads or writes out of bounds.
    x = jnp.pad(xs, ((0, block_rows), (0, 0)))
    zeros = jnp.zeros((a + block_rows, out), jnp.float32)
    # Inside a shard_map (expert parallelism) every operand must vary over the same manual axes.
    starts, ends, x, packed, scale, zeros = vary_alike(starts, ends, x, packed, scale, zeros)
    # f32 inputs get a true f32 dot (Triton's default would be TF32); bf16 ones the tensor-core dot.
    precision = jax.lax.Precision.HIGHEST if xs.dtype == jnp.float32 else None
    kernel = functools.partial(_ragged_kernel, block_rows=block_rows, block_in=block_in, precision=precision)
    per_expert = pl.BlockSpec((1,), lambda g, j: (g,))
    every_row = pl.BlockSpec((a + block_rows, block_out), lambda g, j: (0, j))
    out_tile = pl.pallas_call(
        kernel,
        grid=(experts, out // block_out),
        in_specs=[
            per_expert,  # starts
            per_expert,  # ends
            pl.BlockSpec((a + block_rows, n_in), lambda g, j: (0, 0)),
            pl.BlockSpec((None, block_out, n_in // NIBBLES), lambda g, j: (g, j, 0)),
            pl.BlockSpec((None, block_out, n_in // GROUP), lambda g, j: (g, j, 0)),
            every_row,  # zeros
        ],
        out_specs=every_row,
        out_shape=out_struct((a + block_rows, out), jnp.float32, zeros),
        input_output_aliases={5: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        name="jfire_ragged_dot_int4",
    )(starts, ends, x, packed, scale, zeros)
    return out_tile[:a]


def _ragged_dot_tiled(xs, packed, scale, sizes, *, block_rows, block_out):
    """The Pallas kernel's algorithm in plain lax loops, for any backend and inside any
    shard_map: a loop over (expert, out tile) unpacks one [block_out, in] tile of codes and
    multiplies the expert's rows with it, block_rows at a time, so its buffers are tile-sized
    as the kernel's are. `jfire plan` compiles it to measure the GPU path's workspace on
    XLA:CPU: the interpreted kernel cannot, as JAX 0.10.2's Pallas interpreter fails the
    varying-axes check inside the expert-parallel shard_map."""
    a, n_in = xs.shape
    experts, out, _ = packed.shape
    block_out = min(block_out, out)
    if out % block_out:
        raise ValueError(f"out ({out}) must be a multiple of block_out ({block_out})")
    tiles = out // block_out
    ends = jnp.minimum(jnp.cumsum(sizes.astype(jnp.int32)), a)
    starts = jnp.minimum(ends - sizes.astype(jnp.int32), a)
    x = jnp.pad(xs, ((0, block_rows), (0, 0)))  # a row block may start at any row up to a - 1
    acc = jnp.zeros((a + block_rows, out), jnp.float32)
    # Inside a shard_map that checks varying axes the loop carry must vary as its updates do.
    starts, ends, x, packed, scale, acc = vary_alike(starts, ends, x, packed, scale, acc)
    precision = jax.lax.Precision.HIGHEST if xs.dtype == jnp.float32 else None
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)

    def tile(i, acc):
        g, j = i // tiles, i % tiles
        words = jax.lax.dynamic_index_in_dim(packed, g, keepdims=False)  # [out, in / 8]
        words = jax.lax.dynamic_slice_in_dim(words, j * block_out, block_out)  # [block_out, in / 8]
        groups = jax.lax.dynamic_index_in_dim(scale, g, keepdims=False)
        groups = jax.lax.dynamic_slice_in_dim(groups, j * block_out, block_out)  # [block_out, in / 32]
        w = _unpack(words, groups).astype(xs.dtype)  # [block_out, in]
        start, end = starts[g], ends[g]

        def row_block(b, acc):
            first = start + b * block_rows
            rows = jax.lax.dynamic_slice_in_dim(x, first, block_rows)  # [block_rows, in]
            y = jax.lax.dot_general(
                rows, w, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )  # [block_rows, block_out]
            old = jax.lax.dynamic_slice(acc, (first, j * block_out), (block_rows, block_out))
            new = jnp.where(first + row_ids < end, y, old)  # only this expert's rows
            return jax.lax.dynamic_update_slice(acc, new, (first, j * block_out))

        return jax.lax.fori_loop(0, (end - start + block_rows - 1) // block_rows, row_block, acc)

    return jax.lax.fori_loop(0, experts * tiles, tile, acc)[:a]


@functools.partial(jax.jit, static_argnames=("impl", "block_rows", "block_out", "block_in", "num_warps"))
def ragged_dot_int4(
    xs,
    packed,
    scale,
    sizes,
    *,
    impl: str = "xla",
    block_rows: int = 16,
    block_out: int = 64,
    block_in: int = 128,
    num_warps: int = 4,
):
    """`jax.lax.ragged_dot(xs, dequantize(packed, scale), sizes)` in float32.

    xs [a, in], rows sorted by expert: expert g takes sizes[g] consecutive rows, and rows past
    sum(sizes) come out zero. packed [X, out, in/8], scale [X, out, in/32], sizes [X] int32.
    Returns [a, out] float32. The dot runs in xs's dtype with float32 accumulation.

    impl "xla": unpack all weights, then XLA's ragged_dot (any backend; holds the weights
    unpacked for the call). "pallas" / "pallas-interpret": a Triton-style kernel over
    (expert, out tile) that reads each active expert's packed tile once per block_rows rows and
    unpacks it in registers; empty experts cost one program that exits. On a GPU the tile sizes
    must be powers of two (block_rows >= 16 for the dot). "tiled": the kernel's loops in plain
    lax (any backend, tile-sized buffers; slow: for measuring, see `_ragged_dot_tiled`).
    """
    if impl == "xla":
        w = dequantize(packed, scale, xs.dtype)  # [X, in, out]
        return jax.lax.ragged_dot(xs, w, sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    if impl in ("pallas", "pallas-interpret"):
        return _ragged_dot_pallas(
            xs,
            packed,
            scale,
            sizes,
            interpret=impl == "pallas-interpret",
            block_rows=block_rows,
            block_out=block_out,
            block_in=block_in,
            num_warps=num_warps,
        )
    if impl == "tiled":
        return _ragged_dot_tiled(xs, packed, scale, sizes, block_rows=block_rows, block_out=block_out)
    raise ValueError(f"unknown impl {impl!r}: expected one of {IMPLS}")
