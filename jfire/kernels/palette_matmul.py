"""Random-access bf16 weights: fixed-rate exponent codes read inside the matmul.

The Huffman codec (`jfire.kernels.bf16_decode`) comes closest to the exponent's entropy, but a
value's code can only be found by decoding its lane from the start. This one spends a little
more (about 0.71 of bf16 against 0.67) so that any tile of a weight decodes on its own, from
offsets it can compute: a matmul can read the coded weight and rebuild bf16 right before the
multiply, moving 0.71 of the bytes instead of decoding whole layers into device memory first.

Layout (`PaletteLayout`; the host encoder is `jfire.checkpoint.palette`): the tensor, in its own
axis order, is viewed as [units, rows, cols]: a unit is one layer (or layer and expert) of a
stacked weight, rows are a linear layer's input axes (the matmul's K), cols the rest (its N). It
is cut into tiles of tile_rows x tile_cols values (powers of two, tile_rows a multiple of 32).

  - raw     u8  [units, rows, cols]: sign << 7 | mantissa, as the Huffman codec keeps them;
  - palette u8  [units, row_tiles, col_tiles, 2**k]: each tile's 2**k commonest exponents;
  - codes   u32 [units, ceil(rows / 32) * k, cols]: each value's k-bit index into its tile's
    palette. The codes of rows 32g .. 32g+31 of a column fill words g*k .. g*k+k-1 of that
    column as one little-endian 32k-bit integer (row 32g+j at bits k*j .. k*j+k-1), so a warp
    reading consecutive columns reads consecutive words, and row r's code is at a fixed place;
  - exceptions, the values whose exponent is not in their tile's palette (about 1.5% with k=3,
    almost none with k=4): exc_start u32 [tiles + 1] (tile t's are exc_start[t] ..
    exc_start[t+1]-1, tiles numbered unit, row tile, col tile), exc_pos u16 (position in the
    tile, row * tile_cols + col) and exc_exp u8 (the exponent), each with one unused guard
    entry at the end so that no array is empty. Their code is 0 and is overridden.

k (1..8) is chosen per tensor by the encoder, for the smallest stored size. A tile finds its
codes, palette and exceptions by indexing; no prefix sum over other tiles is needed.

`palette_decode_reference` (plain jnp) decodes a tensor or one unit; `palette_decode` (Pallas)
does the same one tile per program. `palette_matmul_reference` and `palette_matmul` (Pallas,
Triton backend on GPU) compute x @ w for w coded in this layout, with w's rows as the
contraction axis: per program one tile of output columns for a block of x's rows, looping over
the row tiles, each tile rebuilt in bf16 just before its dot. The reference performs the same
dots in the same order on the decoded weight, so in interpret mode the two agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

GROUP = 32  # rows whose codes share k words of a column
TILE_ROWS = 64
TILE_COLS = 64
BLOCK_M = 16  # rows of x per program: Triton's smallest dot


@dataclasses.dataclass(frozen=True)
class PaletteLayout:
    """Where a tensor's values go in the coded form (static: shapes only)."""

    shape: tuple[int, ...]  # the tensor's own shape
    unit_axes: int  # the leading axes whose product is the unit count (layers, experts)
    row_axes: int  # the next axes, whose product is the rows (a linear layer's inputs)
    k: int  # code bits per value: a palette of 2**k exponents per tile
    tile_rows: int = TILE_ROWS
    tile_cols: int = TILE_COLS

    def __post_init__(self):
        tr, tc = self.tile_rows, self.tile_cols
        if not 1 <= self.k <= 8:
            raise ValueError(f"k must be 1..8, got {self.k}")
        if tr % GROUP or tr & (tr - 1) or tc & (tc - 1) or tr * tc > 1 << 16:
            raise ValueError(
                f"tiles must be powers of two, tile_rows a multiple of {GROUP}, at most 65536 values; got {tr}x{tc}"
            )

    @property
    def units(self) -> int:
        return math.prod(self.shape[: self.unit_axes])

    @property
    def rows(self) -> int:
        return math.prod(self.shape[self.unit_axes : self.unit_axes + self.row_axes])

    @property
    def cols(self) -> int:
        return math.prod(self.shape[self.unit_axes + self.row_axes :])

    @property
    def units_per_index(self) -> int:
        """Units per index of the tensor's first axis (a layer's experts; 1 without experts)."""
        return math.prod(self.shape[1 : self.unit_axes])

    @property
    def entries(self) -> int:
        return 1 << self.k

    @property
    def row_tiles(self) -> int:
        return -(-self.rows // self.tile_rows)

    @property
    def col_tiles(self) -> int:
        return -(-self.cols // self.tile_cols)

    @property
    def tiles(self) -> int:
        """Tiles of one unit."""
        return self.row_tiles * self.col_tiles

    @property
    def code_rows(self) -> int:
        return -(-self.rows // GROUP) * self.k

    def shapes(self, exceptions: int) -> dict:
        """(shape, dtype) of every stored array, for a tensor with `exceptions` exceptions."""
        return {
            "codes": ((self.units, self.code_rows, self.cols), jnp.uint32),
            "raw": ((self.units, self.rows, self.cols), jnp.uint8),
            "palette": ((self.units, self.row_tiles, self.col_tiles, self.entries), jnp.uint8),
            "exc_start": ((self.units * self.tiles + 1,), jnp.uint32),
            "exc_pos": ((exceptions + 1,), jnp.uint16),
            "exc_exp": ((exceptions + 1,), jnp.uint8),
        }

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PaletteLayout:
        return cls(
            shape=tuple(int(n) for n in d["shape"]),
            unit_axes=int(d["unit_axes"]),
            row_axes=int(d["row_axes"]),
            k=int(d["k"]),
            tile_rows=int(d["tile_rows"]),
            tile_cols=int(d["tile_cols"]),
        )


ARRAYS = ("codes", "raw", "palette", "exc_start", "exc_pos", "exc_exp")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(ARRAYS), meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class Palette:
    """One palette-coded bf16 tensor (numpy arrays from the encoder, jax arrays on the device)."""

    layout: PaletteLayout
    codes: jax.Array | np.ndarray
    raw: jax.Array | np.ndarray
    palette: jax.Array | np.ndarray
    exc_start: jax.Array | np.ndarray
    exc_pos: jax.Array | np.ndarray
    exc_exp: jax.Array | np.ndarray

    @property
    def exceptions(self) -> int:
        """Room in the exception arrays (past the guard entry); exc_start[-1] of them are used."""
        return int(self.exc_pos.shape[0]) - 1

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in (getattr(self, n) for n in ARRAYS))


def pad_exceptions(p: Palette, room: int) -> Palette:
    """The same tensor with room for `room` exceptions: the decoders read only the entries the
    tiles' offsets name, so tensors of one layout padded to one size share a compiled decoder."""
    extra = room - p.exceptions
    if extra < 0:
        raise ValueError(f"{p.exceptions} exceptions do not fit in {room}")
    if not extra:
        return p
    pad = functools.partial(jnp.pad, pad_width=(0, extra))
    return dataclasses.replace(p, exc_pos=pad(p.exc_pos), exc_exp=pad(p.exc_exp))


def flat(p: Palette) -> Palette:
    """The same coded form read as the [units, rows, cols] tensor: tensors that differ only in
    how their rows and columns split into axes share one compiled decoder."""
    lay = p.layout
    return dataclasses.replace(
        p, layout=dataclasses.replace(lay, shape=(lay.units, lay.rows, lay.cols), unit_axes=1, row_axes=1)
    )


def _assemble(raw, exponent):
    """bf16 bit patterns, as u32, from the raw sign|mantissa byte and the exponent byte."""
    raw = raw.astype(jnp.uint32)
    return ((raw & 0x80) << 8) | (exponent.astype(jnp.uint32) << 7) | (raw & 0x7F)


def _unit_shape(lay: PaletteLayout, unit) -> tuple[int, ...]:
    """The shape decoded: the tensor's, or tensor[unit]'s (`unit` indexes the first axis)."""
    if unit is not None and not lay.unit_axes:
        raise ValueError("a tensor without unit axes decodes whole")
    return lay.shape if unit is None else lay.shape[1:]


# -- the reference decoder ----------------------------------------------------------------------


def _codes(codes: jax.Array | np.ndarray, k: int) -> jax.Array:
    """u8 codes [n, ceil(rows / 32) * 32, cols] from the packed words [n, code rows, cols]."""
    n, _, cols = codes.shape
    words = codes.reshape(n, -1, k, cols)  # [n, groups, k, cols]
    out = []
    for j in range(GROUP):
        w, s = divmod(k * j, 32)
        v = words[:, :, w] >> s
        if s + k > 32:  # straddles two words
            v = v | (words[:, :, w + 1] << (32 - s))
        out.append((v & ((1 << k) - 1)).astype(jnp.uint8))
    return jnp.stack(out, axis=2).reshape(n, -1, cols)


def palette_decode_reference(p: Palette, unit=None) -> jax.Array:
    """The tensor, bf16, in its own shape; with `unit` (which may be traced, e.g. a scan's
    layer index) only tensor[unit], the units of that index of the first axis."""
    lay = p.layout
    shape = _unit_shape(lay, unit)
    tr, tc, rt, ct = lay.tile_rows, lay.tile_cols, lay.row_tiles, lay.col_tiles
    codes, raw, palette = p.codes, p.raw, p.palette
    if unit is not None:
        sub = lay.units_per_index
        codes, raw, palette = (jax.lax.dynamic_slice_in_dim(a, unit * sub, sub) for a in (codes, raw, palette))
    n = codes.shape[0]
    code = _codes(codes, lay.k)
    code = jnp.pad(code, ((0, 0), (0, rt * tr - code.shape[1]), (0, ct * tc - lay.cols)))
    code = code.reshape(n, rt, tr, ct, tc)
    if lay.entries <= 16:  # a select per entry: on XLA:CPU several times faster than a gather
        exponent = jnp.zeros(code.shape, jnp.uint8)
        for j in range(lay.entries):
            exponent = jnp.where(code == j, palette[:, :, None, :, None, j], exponent)
    else:
        tile = jnp.arange(n * rt * ct, dtype=jnp.int32).reshape(n, rt, 1, ct, 1)
        exponent = palette.reshape(-1)[tile * lay.entries + code.astype(jnp.int32)]
    exponent = exponent.reshape(-1)  # [n * rt * tr * ct * tc]
    # Exceptions: the tensor's tile t is tile t - (first unit) * tiles here; others are dropped.
    i = jnp.arange(p.exc_pos.shape[0], dtype=jnp.int32)
    t = jnp.searchsorted(p.exc_start.astype(jnp.int32), i, side="right").astype(jnp.int32) - 1
    if unit is not None:
        t = t - unit * lay.units_per_index * lay.tiles
    pos = p.exc_pos.astype(jnp.int32)
    u, rest = t // lay.tiles, t % lay.tiles
    index = (((u * rt + rest // ct) * tr + pos // tc) * ct + rest % ct) * tc + pos % tc
    valid = (t >= 0) & (t < n * lay.tiles)  # the guard and any padding fall past the last tile
    exponent = exponent.at[jnp.where(valid, index, exponent.shape[0])].set(p.exc_exp, mode="drop")
    exponent = exponent.reshape(n, rt * tr, ct * tc)[:, : lay.rows, : lay.cols]
    bits = _assemble(raw, exponent).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).reshape(shape)


# -- one tile, inside a Pallas kernel -------------------------------------------------------------


def _tile_bits(codes_ref, raw_ref, palette_ref, exc_start_ref, exc_pos_ref, exc_exp_ref, u, tr, tc, lay):
    """(bf16 bits as u32 [tile_rows, tile_cols], in-bounds mask) of tile (tr, tc) of unit u.

    The refs are whole arrays, indexed by gathers. Codes straddling two words (k not a power
    of two) read both; the tile's exceptions overwrite their values one by one.
    """
    k, rows_t, cols_t = lay.k, lay.tile_rows, lay.tile_cols
    r_in = jax.lax.broadcasted_iota(jnp.int32, (rows_t, cols_t), 0)
    c_in = jax.lax.broadcasted_iota(jnp.int32, (rows_t, cols_t), 1)
    r, c = tr * rows_t + r_in, tc * cols_t + c_in
    live = (r < lay.rows) & (c < lay.cols)
    us = jnp.full((rows_t, cols_t), u, jnp.int32)
    bit = k * (r_in % GROUP)
    word = (r // GROUP) * k + bit // 32
    shift = (bit % 32).astype(jnp.uint32)
    lo = plgpu.load(codes_ref.at[us, word, c], mask=live, other=0)
    hi = plgpu.load(codes_ref.at[us, word + 1, c], mask=live & (bit % 32 + k > 32), other=0)
    code = ((lo >> shift) | ((hi << 1) << (31 - shift))) & ((1 << k) - 1)
    trs, tcs = jnp.full_like(us, tr), jnp.full_like(us, tc)
    exponent = plgpu.load(palette_ref.at[us, trs, tcs, code.astype(jnp.int32)], mask=live, other=0)
    t = (u * lay.row_tiles + tr) * lay.col_tiles + tc
    first = exc_start_ref[t].astype(jnp.int32)
    end = exc_start_ref[t + 1].astype(jnp.int32)
    pos = r_in * cols_t + c_in

    def patch(i, exponent):
        return jnp.where(pos == exc_pos_ref[i].astype(jnp.int32), exc_exp_ref[i], exponent)

    exponent = jax.lax.fori_loop(first, end, patch, exponent)
    raw = plgpu.load(raw_ref.at[us, r, c], mask=live, other=0)
    return _assemble(raw, exponent), live


# -- the Pallas decoder ---------------------------------------------------------------------------


def _decode_kernel(unit_ref, codes_ref, raw_ref, palette_ref, exc_start_ref, exc_pos_ref, exc_exp_ref, out_ref, *, lay):
    """One tile of unit unit_ref[0] + program_id(0) into out [n * rows, cols] (u16)."""
    n, tr, tc = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bits, live = _tile_bits(
        codes_ref, raw_ref, palette_ref, exc_start_ref, exc_pos_ref, exc_exp_ref, unit_ref[0] + n, tr, tc, lay
    )
    r = tr * lay.tile_rows + jax.lax.broadcasted_iota(jnp.int32, bits.shape, 0)
    c = tc * lay.tile_cols + jax.lax.broadcasted_iota(jnp.int32, bits.shape, 1)
    # Out-of-bounds positions keep out-of-range indices: masked on the GPU, dropped in
    # interpret mode (a clamped index would collide with a real one).
    out_rows = out_ref.shape[0]
    row = jnp.where(live, n * lay.rows + r, out_rows)
    plgpu.store(out_ref.at[row, jnp.where(live, c, lay.cols)], bits.astype(jnp.uint16), mask=live)


def _arrays(p: Palette):
    return (p.codes, p.raw, p.palette, p.exc_start, p.exc_pos, p.exc_exp)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def palette_decode(p: Palette, unit=None, *, interpret: bool = False, num_warps: int = 4) -> jax.Array:
    """The tensor (or tensor[unit], `unit` maybe traced), bf16, in its own shape; one tile per program."""
    lay = p.layout
    shape = _unit_shape(lay, unit)
    n = lay.units if unit is None else lay.units_per_index
    first = jnp.reshape(jnp.asarray(0 if unit is None else unit * n, jnp.int32), (1,))
    bits = pl.pallas_call(
        functools.partial(_decode_kernel, lay=lay),
        grid=(n, lay.row_tiles, lay.col_tiles),
        out_shape=jax.ShapeDtypeStruct((n * lay.rows, lay.cols), jnp.uint16),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="jfire_palette_decode",
    )(first, *_arrays(p))
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).reshape(shape)


# -- the fused matmul -----------------------------------------------------------------------------


def _precision(dtype):
    # f32 inputs get a true f32 dot (Triton's default would be TF32); bf16 ones the tensor-core dot.
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _weight_tile(bits, live, dtype):
    """bf16 values (exactly, via f32) of a tile's bits, zero outside the tensor."""
    w = jax.lax.bitcast_convert_type(bits << 16, jnp.float32)
    return jnp.where(live, w, 0.0).astype(dtype)


def _matmul_kernel(
    unit_ref, x_ref, codes_ref, raw_ref, palette_ref, exc_start_ref, exc_pos_ref, exc_exp_ref, out_ref, *, lay, block_m
):
    """out[block of rows, tile of columns] = x[rows] @ w[:, columns], w's row tiles one at a time."""
    m0, tc = pl.program_id(0) * block_m, pl.program_id(1)
    m_rows, k_cols = x_ref.shape
    m = m0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, lay.tile_rows), 0)
    kk = jax.lax.broadcasted_iota(jnp.int32, (block_m, lay.tile_rows), 1)
    refs = (codes_ref, raw_ref, palette_ref, exc_start_ref, exc_pos_ref, exc_exp_ref)

    def step(tr, acc):
        col = tr * lay.tile_rows + kk
        x = plgpu.load(x_ref.at[m, col], mask=(m < m_rows) & (col < k_cols), other=0)
        bits, live = _tile_bits(*refs, unit_ref[0], tr, tc, lay)
        w = _weight_tile(bits, live, x.dtype)
        return acc + jnp.dot(x, w, precision=_precision(x.dtype), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, lay.row_tiles, step, jnp.zeros((block_m, lay.tile_cols), jnp.float32))
    rows = m0 + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    cols = tc * lay.tile_cols + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 1)
    ok = (rows < m_rows) & (cols < lay.cols)
    plgpu.store(
        out_ref.at[jnp.where(ok, rows, m_rows), jnp.where(ok, cols, lay.cols)], acc.astype(out_ref.dtype), mask=ok
    )


def _check_matmul(x, lay: PaletteLayout, unit):
    if x.ndim != 2 or x.shape[1] != lay.rows:
        raise ValueError(f"x must be [m, {lay.rows}] (the weight's rows), got {x.shape}")
    if unit is None and lay.units != 1:
        raise ValueError(f"the weight has {lay.units} units: give the one to multiply by")


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "num_warps", "out_dtype"))
def palette_matmul(
    x: jax.Array,
    p: Palette,
    unit=None,
    *,
    interpret: bool = False,
    block_m: int = BLOCK_M,
    num_warps: int = 4,
    out_dtype=None,
) -> jax.Array:
    """x [m, rows] @ w [rows, cols], w read in its palette-coded form and rebuilt tile by tile:
    unit `unit` of a stacked weight (a layer, or with experts layer * experts + expert; it may
    be traced). f32 accumulation, out_dtype (default x's) out, [m, cols]."""
    lay = p.layout
    _check_matmul(x, lay, unit)
    if not interpret and lay.tile_cols < 16:
        raise ValueError(f"tiles of {lay.tile_cols} columns: Triton's dot needs at least 16")
    u = jnp.reshape(jnp.asarray(0 if unit is None else unit, jnp.int32), (1,))
    return pl.pallas_call(
        functools.partial(_matmul_kernel, lay=lay, block_m=block_m),
        grid=(pl.cdiv(x.shape[0], block_m), lay.col_tiles),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], lay.cols), out_dtype or x.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="jfire_palette_matmul",
    )(u, x, *_arrays(p))


def palette_matmul_reference(
    x: jax.Array, p: Palette, unit=None, *, block_m: int = BLOCK_M, out_dtype=None
) -> jax.Array:
    """The kernel's product in plain jnp: the weight decoded by the reference decoder, then the
    same [block_m, tile_rows] x [tile_rows, tile_cols] dots, accumulated over the row tiles in
    the same order (so interpret mode agrees bit for bit)."""
    lay = p.layout
    _check_matmul(x, lay, unit)
    w = palette_decode_reference(flat(p), unit).reshape(lay.rows, lay.cols)  # flat: `unit` counts experts too
    m = x.shape[0]
    mb, rt, ct = -(-m // block_m), lay.row_tiles, lay.col_tiles
    x = jnp.pad(x, ((0, mb * block_m - m), (0, rt * lay.tile_rows - lay.rows)))
    w = jnp.pad(w, ((0, rt * lay.tile_rows - lay.rows), (0, ct * lay.tile_cols - lay.cols))).astype(x.dtype)
    precision = _precision(x.dtype)
    blocks = []
    for i in range(mb):
        row = []
        for j in range(ct):
            acc = jnp.zeros((block_m, lay.tile_cols), jnp.float32)
            for t in range(rt):
                xb = x[i * block_m : (i + 1) * block_m, t * lay.tile_rows : (t + 1) * lay.tile_rows]
                wb = w[t * lay.tile_rows : (t + 1) * lay.tile_rows, j * lay.tile_cols : (j + 1) * lay.tile_cols]
                acc = acc + jnp.dot(xb, wb, precision=precision, preferred_element_type=jnp.float32)
            row.append(acc)
        blocks.append(jnp.concatenate(row, axis=1))
    return jnp.concatenate(blocks, axis=0)[:m, : lay.cols].astype(out_dtype or x.dtype)
