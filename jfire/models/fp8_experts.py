"""Routed-expert weights kept as block-scaled FP8 on the device (DeepSeek-V3 and Kimi K2 as
released), and the grouped matmul that reads them.

Format (the released checkpoints' `quant_method: fp8`): per expert linear, HF layout [out, in],
  - `weight` float8_e4m3fn [out, in];
  - `weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)]: one scale per 128 x 128 block;
  - value w[o, i] = weight[o, i] * scale_inv[o // 128, i // 128] (jfire.checkpoint.fp8).

A byte a weight instead of bf16's two is what lets DeepSeek-V3 (671B parameters) fit 16 H100s.
On a GPU the matmul is a Pallas kernel (jfire.kernels.grouped_matmul) that reads the FP8 bytes
of the experts with rows and scales each tile as it multiplies. Elsewhere it dequantizes the
layer's local experts into the compute dtype and runs XLA's ragged_dot: the FP8 bytes are what
the device holds between steps; the bf16 layer lives for one layer's step.
Activations are not quantized: the result is transformers' dequantized model's, not DeepSeek's
FP8 GEMM's (which also rounds the activations to FP8 per 128 values).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfire.checkpoint.fp8 import BLOCK


def dequantize(weight, scale_inv, dtype=jnp.bfloat16):
    """weight [..., out, in] (float8_e4m3fn, or its bytes as uint8) + scale_inv [..., ceil(out/128), ceil(in/128)] ->
    [..., in, out] (in-major, the engine's expert layout) in `dtype`; the product is taken in
    float32 and rounded once, as loading dequantizes. On a tp shard, `out` (or `in`) is the shard's
    slice: whole blocks of it (DeepseekV3Config.mesh_problems), so block boundaries line up."""
    if weight.dtype == jnp.uint8:
        # The codes' bytes, as `jfire plan` measures them (see FP8_AS_BYTES in jfire/plan_workspace.py).
        weight = jax.lax.bitcast_convert_type(weight, jnp.float8_e4m3fn)
    out, n_in = weight.shape[-2:]
    scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), BLOCK, axis=-2), BLOCK, axis=-1)
    values = weight.astype(jnp.float32) * scale[..., :out, :n_in]
    return jnp.swapaxes(values, -1, -2).astype(dtype)


def ragged_dot_fp8(xs, weight, scale_inv, sizes, *, impl: str = "xla"):
    """`jax.lax.ragged_dot(xs, dequantize(weight, scale_inv), sizes)` in float32: xs [a, in] rows
    sorted by expert, weight [X, out, in], scale_inv [X, out/128, in/128], sizes [X] -> [a, out].

    impl "pallas" / "pallas-interpret" (a GPU's default, `int4_experts.default_impl`): the Pallas
    grouped matmul of jfire.kernels.grouped_matmul, which reads the FP8 bytes of the experts that
    have rows and scales each tile as it reads it, never holding the dequantized layer. "xla":
    the layer dequantized, then XLA's ragged_dot (on CUDA a zero-padded dense dot over every
    expert, DESIGN.md). "tiled": the same dequantized layer multiplied by expert and block of rows
    in plain lax loops, which is what `jfire plan` compiles on XLA:CPU to measure the GPU path's
    buffers (the CPU lowers ragged_dot as a dense emulation that broadcasts the rows to every
    expert, buffers a GPU never holds)."""
    if impl in ("pallas", "pallas-interpret"):
        from jfire.kernels import grouped_matmul

        if grouped_matmul.fits(weight):
            return grouped_matmul.grouped_matmul_fp8(
                xs, weight, scale_inv, sizes.astype(jnp.int32), interpret=impl == "pallas-interpret"
            )
    w = dequantize(weight, scale_inv, xs.dtype)  # [X, in, out]
    if impl == "tiled":
        return _ragged_dot_looped(xs, w, sizes)
    return jax.lax.ragged_dot(xs, w, sizes.astype(jnp.int32), preferred_element_type=jnp.float32)


def _ragged_dot_looped(xs, w, sizes, block_rows: int = 16):
    """ragged_dot as a loop over experts and, within one, over blocks of block_rows rows; rows
    past sum(sizes) stay zero. Works inside the expert-parallel shard_map."""
    from jfire.kernels.varying import vary_alike

    a = xs.shape[0]
    out = w.shape[2]
    ends = jnp.minimum(jnp.cumsum(sizes.astype(jnp.int32)), a)
    starts = jnp.minimum(ends - sizes.astype(jnp.int32), a)
    x = jnp.pad(xs, ((0, block_rows), (0, 0)))  # a row block may start at any row up to a - 1
    acc = jnp.zeros((a + block_rows, out), jnp.float32)
    starts, ends, x, w, acc = vary_alike(starts, ends, x, w, acc)
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)

    def expert(g, acc):
        weights = jax.lax.dynamic_index_in_dim(w, g, keepdims=False)  # [in, out]
        start, end = starts[g], ends[g]

        def row_block(b, acc):
            first = start + b * block_rows
            rows = jax.lax.dynamic_slice_in_dim(x, first, block_rows)  # [block_rows, in]
            y = jnp.dot(rows, weights, preferred_element_type=jnp.float32)
            old = jax.lax.dynamic_slice(acc, (first, 0), (block_rows, out))
            new = jnp.where(first + row_ids < end, y, old)  # only this expert's rows
            return jax.lax.dynamic_update_slice(acc, new, (first, 0))

        return jax.lax.fori_loop(0, (end - start + block_rows - 1) // block_rows, row_block, acc)

    return jax.lax.fori_loop(0, w.shape[0], expert, acc)[:a]
