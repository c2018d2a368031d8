"""Lossless bf16 decompression on the device: a plain-jnp reference and a Pallas kernel.

A bf16 value is sign (1 bit), exponent (8) and mantissa (7). Sign and mantissa are close to
uniformly random in trained weights and are kept raw, one byte per value; the exponent
carries ~2.6 bits of information and is Huffman-coded (canonical, at most CODE_BITS bits).

Layout (chosen by the encoder, `jfire.checkpoint.codec`, and recorded in `Layout`):
  - the tensor is transposed by `perm` into its *encode layout* and viewed as
    [units, rows, cols]: a unit (one layer of a layer-stacked weight, else the whole tensor)
    has its own code table; rows are the product of the axes a mesh may shard;
  - each row is cut into `lanes` interleaved lanes: lane l holds columns l, l+lanes, ...,
    and its exponents form one bitstream (MSB first). Lanes are independent, which is what a
    GPU wants: thousands of them decode side by side, one symbol per step each;
  - the streams of a row follow each other bit-packed; each row starts on a 32-bit word,
    so any set of whole rows (a device's shard) is decodable from its own words alone;
  - stored per tensor: code lengths [units, 256] (u8), lane bit lengths [units, rows,
    lanes] (u16), the raw sign|mantissa bytes [units, rows, cols] (u8) and the payload
    words (u32, plus one zero guard word). Lane start offsets are prefix sums of the lane
    lengths, recomputed here on the device.

Decoding a step of a lane: peek CODE_BITS bits at the lane's bit position (two word reads),
look the symbol and its length up in a 2**CODE_BITS-entry table, advance. Both decoders run
the same step over all lanes; they differ in how the output is laid down (the reference
stacks steps and transposes, the kernel scatters each step into place).
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

CODE_BITS = 12  # longest code; the decode table has 2**CODE_BITS entries
SYMBOLS = 256


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a tensor's values go in the coded form (static: shapes and orders only)."""

    shape: tuple[int, ...]  # the tensor's own shape
    perm: tuple[int, ...]  # encode layout = tensor.transpose(perm)
    unit_axes: int  # 1: the first encode axis indexes separately coded units (layers); else 0
    row_axes: int  # how many encode axes after the unit axis make up the rows
    lanes: int  # lanes per row, a power of two

    @property
    def enc_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[p] for p in self.perm)

    @property
    def units(self) -> int:
        return self.enc_shape[0] if self.unit_axes else 1

    @property
    def rows(self) -> int:
        return math.prod(self.enc_shape[self.unit_axes : self.unit_axes + self.row_axes])

    @property
    def cols(self) -> int:
        return math.prod(self.enc_shape[self.unit_axes + self.row_axes :])

    @property
    def steps(self) -> int:
        """Symbols in the longest lane."""
        return -(-self.cols // self.lanes)

    def encoded(self) -> Layout:
        """The same coded form read as the encode-layout tensor itself (no transpose back):
        tensors that differ only in axis order then share one compiled decoder."""
        return dataclasses.replace(self, shape=self.enc_shape, perm=tuple(range(len(self.shape))))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Layout:
        return cls(
            shape=tuple(d["shape"]),
            perm=tuple(d["perm"]),
            unit_axes=int(d["unit_axes"]),
            row_axes=int(d["row_axes"]),
            lanes=int(d["lanes"]),
        )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["code_lengths", "lane_bits", "raw", "payload"],
    meta_fields=["layout"],
)
@dataclasses.dataclass(frozen=True)
class Compressed:
    """One compressed bf16 tensor (numpy arrays from the encoder, jax arrays on the device)."""

    layout: Layout
    code_lengths: jax.Array  # u8 [units, 256]
    lane_bits: jax.Array  # u16 [units, rows, lanes]
    raw: jax.Array  # u8 [units, rows, cols]: sign << 7 | mantissa
    payload: jax.Array  # u32 [words + 1]

    @property
    def nbytes(self) -> int:
        return sum(
            int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
            for a in (self.code_lengths, self.lane_bits, self.raw, self.payload)
        )


def pad_payload(c: Compressed, words: int) -> Compressed:
    """The same tensor with its payload zero-padded to `words`: the decoders never read past
    the last lane's end and its guard word, so equal-layout tensors padded to one size share
    one compiled decoder."""
    extra = words - c.payload.shape[0]
    if extra < 0:
        raise ValueError(f"payload has {c.payload.shape[0]} words, more than {words}")
    return dataclasses.replace(c, payload=jnp.pad(c.payload, (0, extra)) if extra else c.payload)


# -- shared pieces: the decode table, lane offsets, output assembly ---------------------------------


def build_lut(code_lengths: jax.Array) -> jax.Array:
    """Decode tables [..., 2**CODE_BITS] int32 (symbol | length << 8) from code lengths [..., 256].

    Canonical codes sorted by (length, symbol) occupy consecutive intervals of the
    CODE_BITS-bit window space, each 2**(CODE_BITS - length) wide; a window decodes to the
    symbol whose interval holds it. (Written with comparisons rather than a sort: it
    compiles in a fraction of the time, and the tables are small.)
    """
    lengths = code_lengths.astype(jnp.int32)
    width = jnp.where(lengths > 0, jnp.left_shift(1, jnp.clip(CODE_BITS - lengths, 0, CODE_BITS)), 0)
    key = lengths * SYMBOLS + jnp.arange(SYMBOLS)
    before = key[..., None, :] < key[..., :, None]  # [..., s, t]: t's code precedes s's
    start = jnp.sum(jnp.where(before, width[..., None, :], 0), axis=-1)
    windows = jnp.arange(1 << CODE_BITS)[:, None]
    hit = (windows >= start[..., None, :]) & (windows < (start + width)[..., None, :])  # [..., window, symbol]
    symbol = jnp.argmax(hit, axis=-1).astype(jnp.int32)
    return symbol | (jnp.take_along_axis(lengths, symbol, axis=-1) << 8)


def lane_starts(lane_bits: jax.Array, base_word=0) -> tuple[jax.Array, jax.Array]:
    """First payload word and bit (0..31) of every lane, for lane bit lengths [rows, lanes]
    whose first row starts at payload word `base_word`."""
    bits = lane_bits.astype(jnp.int32)
    row_words = (bits.sum(axis=-1) + 31) >> 5
    row_start = base_word + jnp.cumsum(row_words) - row_words
    within = jnp.cumsum(bits, axis=-1) - bits
    return row_start[:, None] + (within >> 5), within & 31


def unit_base_words(lane_bits: jax.Array) -> jax.Array:
    """The payload word each unit starts at: [units] int32 from lane bit lengths [units, rows, lanes]."""
    unit_words = ((lane_bits.astype(jnp.int32).sum(axis=-1) + 31) >> 5).sum(axis=-1)
    return jnp.cumsum(unit_words) - unit_words


def _peek(payload: jax.Array, word: jax.Array, bit: jax.Array) -> jax.Array:
    """The CODE_BITS bits of the stream starting at (word, bit), as int32 table indices."""
    hi = payload[word]
    lo = payload[word + 1]
    s = bit.astype(jnp.uint32)
    # lo >> (32 - s) without shifting by 32 when s == 0.
    window = (hi << s) | ((lo >> 1) >> (31 - s))
    return (window >> (32 - CODE_BITS)).astype(jnp.int32)


def _assemble(raw: jax.Array, exponent: jax.Array) -> jax.Array:
    """bf16 bit patterns (u16) from the raw sign|mantissa byte and the exponent byte."""
    raw = raw.astype(jnp.uint16)
    return ((raw & 0x80) << 8) | (exponent.astype(jnp.uint16) << 7) | (raw & 0x7F)


def _from_encode_layout(bits: jax.Array, layout: Layout, unit: bool) -> jax.Array:
    """[..., cols] u16 in encode layout back to bf16 in the tensor's own axis order
    (for one unit when `unit`, i.e. without the leading unit axis)."""
    values = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    if not unit:
        return values.reshape(layout.enc_shape).transpose(np.argsort(layout.perm))
    rest = [p - 1 for p in layout.perm[1:]]  # the unit axis is axis 0 in both layouts
    return values.reshape(layout.enc_shape[1:]).transpose(np.argsort(rest))


def _rows_to_decode(c: Compressed, unit):
    """(first row, row count, decode tables, lane start words and bits) for the whole tensor
    (unit None) or one unit; rows index the flat [units * rows, cols] view."""
    lay = c.layout
    if unit is None:
        word, bit = lane_starts(c.lane_bits.reshape(lay.units * lay.rows, lay.lanes))
        return 0, lay.units * lay.rows, build_lut(c.code_lengths), word, bit
    lane_bits = jax.lax.dynamic_index_in_dim(c.lane_bits, unit, keepdims=False)
    word, bit = lane_starts(lane_bits, unit_base_words(c.lane_bits)[unit])
    lut = build_lut(jax.lax.dynamic_slice_in_dim(c.code_lengths, unit, 1))
    return unit * lay.rows, lay.rows, lut, word, bit


# -- the reference decoder --------------------------------------------------------------------------


def bf16_decode_reference(c: Compressed, unit=None) -> jax.Array:
    """The tensor (or one unit of it), bf16, in its own axis order: all lanes step together;
    the symbols of each step are stacked and transposed into column order."""
    lay = c.layout
    first_row, rows, lut, word, bit = _rows_to_decode(c, unit)
    lanes, steps = lay.lanes, lay.steps
    lane_unit = (jnp.arange(rows * lanes) // (lay.rows * lanes)).astype(jnp.int32)
    word, bit = word.reshape(-1), bit.reshape(-1)
    last = c.payload.shape[0] - 2  # lanes past their end read garbage, never out of bounds

    def step(pos, _):
        w = jnp.minimum(word + (pos >> 5), last)
        entry = lut[lane_unit, _peek(c.payload, w, pos & 31)]
        return pos + (entry >> 8), (entry & 0xFF).astype(jnp.uint8)

    _, symbols = jax.lax.scan(step, bit, None, length=steps)  # [steps, rows * lanes]
    exponent = symbols.reshape(steps, rows, lanes).transpose(1, 0, 2).reshape(rows, steps * lanes)
    raw = jax.lax.dynamic_slice_in_dim(c.raw.reshape(lay.units * lay.rows, lay.cols), first_row, rows)
    return _from_encode_layout(_assemble(raw, exponent[:, : lay.cols]), lay, unit=unit is not None)


# -- the Pallas kernel ------------------------------------------------------------------------------


def _decode_kernel(
    first_row_ref,
    word_ref,
    bit_ref,
    lut_ref,
    payload_ref,
    raw_ref,
    out_ref,
    *,
    rows: int,
    unit_rows: int,
    cols: int,
    lanes: int,
    steps: int,
    tile_rows: int,
    tile_lanes: int,
    last_word: int,
):
    """One tile of lanes (tile_rows rows x tile_lanes lanes), stepping one symbol per lane.

    Refs are whole arrays, indexed by gather/scatter: word_ref/bit_ref [rows, lanes] lane
    starts; lut_ref [rows // unit_rows, 2**CODE_BITS]; payload_ref [words]; raw_ref
    [all rows, cols] where this call's row r is row first_row + r; out_ref [rows, cols] u16.
    """
    k = jax.lax.broadcasted_iota(jnp.int32, (tile_rows * tile_lanes,), 0)
    row = pl.program_id(0) * tile_rows + k // tile_lanes
    lane = pl.program_id(1) * tile_lanes + k % tile_lanes
    live = row < rows
    # Inactive lanes keep out-of-range indices: on the GPU their accesses are masked off;
    # in interpret mode out-of-range stores are dropped (a clamped index would collide).
    src_row = first_row_ref[0] + row
    unit = row // unit_rows  # this call's tables: all units', or the one unit's
    word0 = plgpu.load(word_ref.at[row, lane], mask=live, other=0)
    bit0 = plgpu.load(bit_ref.at[row, lane], mask=live, other=0)

    def step(j, pos):
        col = lane + j * lanes
        active = live & (col < cols)
        word = jnp.clip(word0 + (pos >> 5), 0, last_word)
        hi = plgpu.load(payload_ref.at[word], mask=active, other=0)
        lo = plgpu.load(payload_ref.at[word + 1], mask=active, other=0)
        s = (pos & 31).astype(jnp.uint32)
        window = (hi << s) | ((lo >> 1) >> (31 - s))
        entry = plgpu.load(lut_ref.at[unit, (window >> (32 - CODE_BITS)).astype(jnp.int32)], mask=active, other=0)
        raw = plgpu.load(raw_ref.at[src_row, col], mask=active, other=0).astype(jnp.uint32)
        value = ((raw & 0x80) << 8) | ((entry & 0xFF).astype(jnp.uint32) << 7) | (raw & 0x7F)
        plgpu.store(out_ref.at[row, col], value.astype(jnp.uint16), mask=active)
        return pos + jnp.where(active, entry >> 8, 0)

    jax.lax.fori_loop(0, steps, step, bit0)


def _tile(rows: int, lanes: int, block_lanes: int) -> tuple[int, int]:
    """(rows, lanes) of one program's tile: powers of two, about block_lanes lanes in all."""
    tile_lanes = min(lanes, block_lanes)
    tile_rows = min(max(1, block_lanes // tile_lanes), pl.next_power_of_2(rows))
    return tile_rows, tile_lanes


def _decode_rows(c: Compressed, unit, *, interpret: bool, block_lanes: int, num_warps: int) -> jax.Array:
    """u16 [rows, cols] in encode layout, for the whole tensor (unit None) or one unit."""
    lay = c.layout
    first_row, rows, lut, word, bit = _rows_to_decode(c, unit)
    tile_rows, tile_lanes = _tile(rows, lay.lanes, block_lanes)
    kernel = functools.partial(
        _decode_kernel,
        rows=rows,
        unit_rows=lay.rows,
        cols=lay.cols,
        lanes=lay.lanes,
        steps=lay.steps,
        tile_rows=tile_rows,
        tile_lanes=tile_lanes,
        last_word=c.payload.shape[0] - 2,
    )
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows, tile_rows), lay.lanes // tile_lanes),
        out_shape=jax.ShapeDtypeStruct((rows, lay.cols), jnp.uint16),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="jfire_bf16_decode",
    )(
        jnp.reshape(first_row, (1,)).astype(jnp.int32),
        word,
        bit,
        lut,
        c.payload,
        c.raw.reshape(lay.units * lay.rows, lay.cols),
    )


@functools.partial(jax.jit, static_argnames=("interpret", "block_lanes", "num_warps"))
def bf16_decode(
    c: Compressed, unit=None, *, interpret: bool = False, block_lanes: int = 256, num_warps: int = 4
) -> jax.Array:
    """The tensor, bf16, in its own shape, decoded by the Pallas kernel; with `unit` (which
    may be traced, e.g. a scan's layer index) only that unit, shaped like tensor[unit]."""
    bits = _decode_rows(c, unit, interpret=interpret, block_lanes=block_lanes, num_warps=num_warps)
    return _from_encode_layout(bits, c.layout, unit=unit is not None)
