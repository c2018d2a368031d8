"""The routed experts' grouped matmul on a GPU, for bf16 (or float32) and block-scaled FP8 weights.

`out[r] = x[r] @ w[expert_of(r)]`: rows x [a, in] sorted by expert, expert g taking sizes[g]
consecutive rows, as `jax.lax.ragged_dot` computes it (float32 accumulation, float32 out, rows
past sum(sizes) zero). On CUDA, jaxlib rewrites ragged_dot into a zero-padded dense dot over
every expert (DESIGN.md), which at decode reads every expert's weights; this kernel reads only
the weights of experts that have rows.

Schedule (a ragged one, as megablox and jax's `ragged_dot_mgpu` tile theirs): each expert's rows
are cut into tiles of `block_rows` starting at the expert's first row, and the tiles of all
experts are numbered in order (`_row_tiles`, computed by XLA beside the kernel: a few [experts]
and [tiles] int32 vectors). The grid is (row tile, output column tile, K split); a program
multiplies its tile's rows by one [in, block_out] column tile of its expert's weights, block_in
inputs at a time, and stores the rows that are its expert's. The number of row tiles is not
known when tracing; the grid holds its bound, cdiv(a, block_rows) + min(experts, a), and
programs past the real count exit at once. An expert with no rows owns no tile: no program
reads its weights. Rows, columns and inputs that do not fill a tile are masked, so any shape
works (every tile dimension is a power of two, as Triton needs).

Tiles (`choose_tiles`): prefill-sized batches (many rows an expert) take 64 or 128-row tiles and
128 output columns; decode-sized ones (a few rows an expert) 16-row tiles (the smallest tensor-
core dot), narrower column tiles and, if there are still too few programs to keep the GPU's
SMs streaming weights, a split of the input axis whose partial sums XLA adds.

FP8 (`grouped_matmul_fp8`, DeepSeek-V3 / Kimi K2 as released, jfire.models.fp8_experts): the
weight is read as its float8_e4m3fn bytes in the source's [experts, out, in] layout beside the
float32 `scale_inv` [experts, ceil(out / 128), ceil(in / 128)]. Tiles are at most 128 wide and
divide 128, so a weight tile lies in one 128 x 128 scale block: the kernel converts the tile to
float32, multiplies it by that block's scale and rounds it to the activations' dtype, exactly as
`fp8_experts.dequantize` does for the whole layer, then runs the same dot. Activations are not
quantized.

The XLA path stays selectable: `jfire.kernels.int4_experts.use_impl("xla")` (jfire.models.moe).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jfire.checkpoint.fp8 import BLOCK as FP8_BLOCK
from jfire.kernels.varying import out_struct, vary_alike

# An H100's streaming multiprocessors (132; an H200 has as many): decode tiles aim for at least
# two programs on each, so that enough loads are in flight to stream the weights.
TARGET_PROGRAMS = 2 * 132


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A kernel configuration: tile sizes (powers of two, rows and columns >= 16 for the
    tensor-core dot), how many pieces the input axis is split into, and Triton's warps and
    software-pipeline stages."""

    rows: int = 16
    out: int = 128
    inner: int = 64
    k_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("rows", "out", "inner"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"tile {name} must be a power of two >= 16, got {size}")
        if self.k_splits < 1:
            raise ValueError(f"k_splits must be >= 1, got {self.k_splits}")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def choose_tiles(a: int, experts: int, n_in: int, out: int) -> Tiles:
    """Tiles for `a` rows over `experts` experts of [in, out] weights (chosen from shapes alone:
    routing is not known when tracing). Not yet tuned on a GPU: scripts/gpu_check.py times the
    choice at Scout's shapes against XLA's ragged_dot and the dense layer."""
    active = max(1, min(a, experts))  # experts that can hold rows, at most
    per_expert = -(-a // active)
    rows = min(128, max(16, _pow2_at_least(per_expert)))
    if rows >= 64:  # prefill: big tiles, the weight tile reused over many rows
        return Tiles(rows=rows, out=128, inner=64, num_warps=8 if rows == 128 else 4, num_stages=3)
    out_tile = min(128, max(16, _pow2_at_least(out)))
    while out_tile > 32 and active * -(-out // out_tile) < TARGET_PROGRAMS:
        out_tile //= 2
    inner = min(128, max(16, _pow2_at_least(n_in)))
    programs = active * -(-out // out_tile)
    steps = -(-n_in // inner)
    k_splits = max(1, min(TARGET_PROGRAMS // programs, steps // 8))  # each split >= 8 steps
    return Tiles(rows=rows, out=out_tile, inner=inner, k_splits=k_splits, num_warps=4, num_stages=4)


def _row_tiles(sizes, a: int, block_rows: int, num_tiles: int):
    """(expert, first row, end row) of each of `num_tiles` row tiles, int32 [num_tiles] each.

    Expert g's rows [start_g, end_g) are cut into tiles of block_rows from start_g; tiles past
    the real count are empty (first == end). Sizes summing past `a` are cut at `a`."""
    total = jnp.cumsum(sizes.astype(jnp.int32))
    ends, starts = jnp.minimum(total, a), jnp.minimum(total - sizes.astype(jnp.int32), a)
    count = (ends - starts + block_rows - 1) // block_rows  # [E] tiles of each expert
    last_tile = jnp.cumsum(count)  # [E] one past each expert's last tile
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    expert = jnp.sum(last_tile[None, :] <= tile[:, None], axis=1, dtype=jnp.int32)  # [T]
    live = expert < sizes.shape[0]
    expert = jnp.minimum(expert, sizes.shape[0] - 1)
    first = starts[expert] + (tile - (last_tile[expert] - count[expert])) * block_rows
    end = jnp.where(live, ends[expert], first)
    return expert, first, end


def _kernel(expert_ref, first_ref, end_ref, x_ref, w_ref, *refs, tiles: Tiles, n_in, n_out, steps, fp8, precision):
    """One (row tile, column tile, K split): rows [first, end) of the tile's expert times the
    expert's weight columns [j * block_out, (j + 1) * block_out), inputs of this split.

    x_ref [a, in]; w_ref [E, in, out] (bf16/f32) or [E, out, in] (FP8); scale_ref (FP8 only)
    [E, ceil(out / 128), ceil(in / 128)]; o_ref [k_splits, a, out] float32, aliased to zeros:
    a program stores only its own rows, so rows no expert owns stay zero."""
    scale_ref, o_ref = (refs[0], refs[2]) if fp8 else (None, refs[1])  # the zeros' ref is o_ref's alias
    tm, tn, bk = tiles.rows, tiles.out, tiles.inner
    g, first, end = expert_ref[0], first_ref[0], end_ref[0]
    j, split = pl.program_id(1), pl.program_id(2)
    per_split = -(-steps // tiles.k_splits)
    compute = x_ref.dtype

    @pl.when(first < end)
    def tile():
        row_ok = first + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0) < end  # [tm, 1]
        cols = j * tn + jax.lax.broadcasted_iota(jnp.int32, (1, tn), 1)  # [1, tn]
        # Masks only where a tile can overhang: columns past out, inputs past in.
        out_ok = None if n_out % tn == 0 else (cols.reshape(tn, 1) if fp8 else cols) < n_out
        ragged_k = n_in % bk != 0

        def step(k, acc):
            ins = k * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)  # [1, bk]
            x_mask = row_ok & (ins < n_in) if ragged_k else row_ok
            in_ok = ((ins if fp8 else ins.reshape(bk, 1)) < n_in) if ragged_k else None
            w_mask = _both(out_ok, in_ok)
            x = plgpu.load(x_ref.at[pl.ds(first, tm), pl.ds(k * bk, bk)], mask=_full(x_mask, (tm, bk)), other=0)
            if fp8:
                w_at = w_ref.at[g, pl.ds(j * tn, tn), pl.ds(k * bk, bk)]  # [tn, bk]
            else:
                w_at = w_ref.at[g, pl.ds(k * bk, bk), pl.ds(j * tn, tn)]  # [bk, tn]
            if w_mask is None:
                w = plgpu.load(w_at)
            else:
                w = plgpu.load(w_at, mask=_full(w_mask, w_at.shape), other=jnp.zeros((), w_at.dtype))
            if fp8:
                # The tile lies in one 128 x 128 block: its scale, then rounded as dequantize rounds.
                s = scale_ref[g, jax.lax.div(j * tn, FP8_BLOCK), jax.lax.div(k * bk, FP8_BLOCK)]
                w = (w.astype(jnp.float32) * s).astype(compute)
                dims = (((1,), (1,)), ((), ()))  # x [tm, bk] . w [tn, bk]
            else:
                w = w.astype(compute)
                dims = (((1,), (0,)), ((), ()))  # x [tm, bk] . w [bk, tn]
            return acc + jax.lax.dot_general(x, w, dims, precision=precision, preferred_element_type=jnp.float32)

        lo = split * per_split
        hi = jnp.minimum(lo + per_split, steps)
        acc = jax.lax.fori_loop(lo, hi, step, jnp.zeros((tm, tn), jnp.float32))
        store_ok = row_ok & (cols < n_out) if n_out % tn else row_ok
        plgpu.store(o_ref.at[split, pl.ds(first, tm), pl.ds(j * tn, tn)], acc, mask=_full(store_ok, (tm, tn)))


def _both(a, b):
    return b if a is None else a if b is None else a & b


def _full(mask, shape):
    return jnp.broadcast_to(mask, tuple(shape))


def fits(w) -> bool:
    """Whether the kernel can take expert weights `w` ([E, in, out] or FP8 [E, out, in]): Pallas'
    Triton lowering computes element offsets in int32."""
    return w.size < 2**31


def _grouped(xs, w, scale, sizes, *, fp8: bool, interpret: bool, tiles: Tiles | None, name: str):
    a, n_in = xs.shape
    experts = w.shape[0]
    n_out = w.shape[1] if fp8 else w.shape[2]
    if (w.shape[2] if fp8 else w.shape[1]) != n_in or sizes.shape != (experts,):
        raise ValueError(f"rows {xs.shape}, weights {w.shape} ({'out, in' if fp8 else 'in, out'}), sizes {sizes.shape}")
    tiles = tiles or choose_tiles(a, experts, n_in, n_out)
    if not fits(w) or a * max(n_in, tiles.k_splits * n_out) >= 2**31:
        raise ValueError(
            f"rows {xs.shape} or weights {w.shape}: 2**31 elements or more, past the kernel's int32 offsets"
        )
    if fp8 and (tiles.out > FP8_BLOCK or tiles.inner > FP8_BLOCK):
        raise ValueError(f"FP8 tiles must lie in one {FP8_BLOCK} x {FP8_BLOCK} scale block: {tiles}")
    if a == 0:
        return jnp.zeros((0, n_out), jnp.float32)
    num_tiles = -(-a // tiles.rows) + min(experts, a)
    expert, first, end = _row_tiles(sizes, a, tiles.rows, num_tiles)
    steps = -(-n_in // tiles.inner)
    zeros = jnp.zeros((tiles.k_splits, a, n_out), jnp.float32)
    operands = [expert, first, end, xs, w] + ([scale.astype(jnp.float32)] if fp8 else []) + [zeros]
    # Inside a shard_map (expert parallelism) every operand must vary over the same manual axes.
    operands = vary_alike(*operands)
    # f32 inputs get a true f32 dot (Triton's default would be TF32); bf16 ones the tensor-core dot.
    precision = jax.lax.Precision.HIGHEST if xs.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, tiles=tiles, n_in=n_in, n_out=n_out, steps=steps, fp8=fp8, precision=precision)
    per_tile = pl.BlockSpec((1,), lambda i, j, s: (i,))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda i, j, s: (0,) * x.ndim)

    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, -(-n_out // tiles.out), tiles.k_splits),
        in_specs=[per_tile, per_tile, per_tile] + [whole(x) for x in operands[3:]],
        out_specs=whole(zeros),
        out_shape=out_struct(zeros.shape, jnp.float32, operands[-1]),
        input_output_aliases={len(operands) - 1: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name=name,
    )(*operands)
    return out[0] if tiles.k_splits == 1 else jnp.sum(out, axis=0)


@functools.partial(jax.jit, static_argnames=("interpret", "tiles"))
def grouped_matmul(xs, w, sizes, *, interpret: bool = False, tiles: Tiles | None = None):
    """`jax.lax.ragged_dot(xs, w, sizes, preferred_element_type=float32)` as a Pallas kernel.

    xs [a, in] rows sorted by expert; w [E, in, out] (the engine's expert layout, any float
    dtype: each tile is cast to xs's dtype for the dot); sizes [E] int32. Returns [a, out]
    float32; rows past sum(sizes) are zero. `tiles` None: `choose_tiles`'s."""
    return _grouped(xs, w, None, sizes, fp8=False, interpret=interpret, tiles=tiles, name="jfire_grouped_matmul")


@functools.partial(jax.jit, static_argnames=("interpret", "tiles"))
def grouped_matmul_fp8(xs, weight, scale_inv, sizes, *, interpret: bool = False, tiles: Tiles | None = None):
    """`jax.lax.ragged_dot(xs, fp8_experts.dequantize(weight, scale_inv, xs.dtype), sizes)` in
    float32 without the dequantized layer: weight [E, out, in] float8_e4m3fn (or its bytes as
    uint8), scale_inv [E, ceil(out/128), ceil(in/128)]; each weight tile is scaled as it is read."""
    if weight.dtype == jnp.uint8:
        weight = jax.lax.bitcast_convert_type(weight, jnp.float8_e4m3fn)
    return _grouped(
        xs, weight, scale_inv, sizes, fp8=True, interpret=interpret, tiles=tiles, name="jfire_grouped_matmul_fp8"
    )


# -- the references (plain jnp) --------------------------------------------------------------------


def grouped_matmul_reference(xs, w, sizes):
    """XLA's grouped matmul, the kernel's specification."""
    return jax.lax.ragged_dot(xs, w.astype(xs.dtype), sizes.astype(jnp.int32), preferred_element_type=jnp.float32)


def grouped_matmul_fp8_reference(xs, weight, scale_inv, sizes):
    """The layer dequantized into xs's dtype (each value its FP8 code times its block's scale in
    float32, rounded once, as `jfire.models.fp8_experts.dequantize` does), then XLA's grouped matmul."""
    if weight.dtype == jnp.uint8:
        weight = jax.lax.bitcast_convert_type(weight, jnp.float8_e4m3fn)
    out, n_in = weight.shape[-2:]
    scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)
    w = (weight.astype(jnp.float32) * scale[..., :out, :n_in]).astype(xs.dtype)  # [E, out, in]
    return grouped_matmul_reference(xs, jnp.swapaxes(w, -1, -2), sizes)
