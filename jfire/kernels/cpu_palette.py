"""bfloat16 layer weights kept palette-coded in CPU memory and multiplied coded
(`cpu_palette.cc`): the CPU's compressed-resident form.

Batch-1 decode on a CPU reads every weight once a step and is bound by those bytes. A
`CpuPalette` stack holds 0.754 of bfloat16's bytes (plus about 0.05% of values as exceptions on
the default model), and the kernel rebuilds each value in registers right before its
multiply-add, with the float32 kernels' order of sums: the product equals `jfire_stacked_matmul`'s
on the bfloat16 weight bit for bit, so an engine serving the coded form gives the bfloat16
engine's tokens.

The form (cpu_palette.cc has the byte layout): per layer of a stack viewed as [k, n] (k a
multiple of 32, n of 64), blocks of 32 rows x 64 columns, each with its own palette of the 16
commonest exponents, 4-bit codes, and the raw sign and mantissa bytes; values whose exponent is
not in their block's palette are listed apart. It is built on the host from the bfloat16 values
(`encode`), whatever the checkpoint held (plain, Huffman- or palette-coded: the checkpoint
codecs' 3-bit palettes leave 1.7% exceptions, too many to patch in a product's inner loop,
while 16 exponents a block leave almost none).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jfire.kernels import cpu_matmul

BLOCK_ROWS, BLOCK_COLS = 32, 64
PALETTE = 16  # exponents a block: 4-bit codes
BLOCK_BYTES = PALETTE + 4 * BLOCK_COLS * 4 + BLOCK_ROWS * BLOCK_COLS  # palette, codes, raw bytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CpuPalette:
    """A layer-stacked bfloat16 weight [layers, in..., out...] in the coded form: `blocks` u8
    [layers, bytes], `exc_start` u32 [layers, blocks + 1], `exc` u32 [layers, entries + 1]
    (one guard entry, so that no array is empty). `n_in`: how many of the weight's axes after
    the layer axis are its inputs (contracted)."""

    blocks: jax.Array
    exc_start: jax.Array
    exc: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    n_in: int = dataclasses.field(metadata=dict(static=True))

    dtype = jnp.bfloat16  # what it holds; what `layer_matmuls` and memory accounting read
    ndim = property(lambda self: len(self.shape))

    @property
    def k(self) -> int:
        return matrix_dims(self.shape, self.n_in)[0]

    @property
    def n(self) -> int:
        return matrix_dims(self.shape, self.n_in)[1]

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes + self.exc_start.nbytes + self.exc.nbytes)

    def layer(self, index) -> jax.Array:
        """Layer `index` (maybe traced) as bfloat16 [in..., out...]."""
        out = jax.ffi.ffi_call(_target("jfire_palette_decode"), jax.ShapeDtypeStruct((self.k, self.n), jnp.bfloat16))(
            jnp.asarray(index, jnp.int32).reshape(1), self.blocks, self.exc_start, self.exc
        )
        return out.reshape(self.shape[1:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CpuPaletteTable:
    """A bfloat16 table [n, k] (the tied embedding) in the coded form, as a one-layer stack:
    its rows are looked up (`table[ids]`) and it multiplies as the output head (`matmul_nt`)."""

    blocks: jax.Array
    exc_start: jax.Array
    exc: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    dtype = jnp.bfloat16
    ndim = 2

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes + self.exc_start.nbytes + self.exc.nbytes)

    def __getitem__(self, ids) -> jax.Array:
        """Rows `ids` (an int array of any shape) as bfloat16 [*ids.shape, k]."""
        ids = jnp.asarray(ids, jnp.int32)
        out = jax.ffi.ffi_call(
            _target("jfire_palette_rows"), jax.ShapeDtypeStruct((ids.size, self.shape[1]), jnp.bfloat16)
        )(ids.reshape(-1), self.blocks, self.exc_start, self.exc)
        return out.reshape(*ids.shape, self.shape[1])

    def decoded(self) -> jax.Array:
        """The whole table as bfloat16 [n, k]."""
        return jax.ffi.ffi_call(_target("jfire_palette_decode"), jax.ShapeDtypeStruct(self.shape, jnp.bfloat16))(
            jnp.zeros(1, jnp.int32), self.blocks, self.exc_start, self.exc
        )


def encode_table(table: np.ndarray) -> CpuPaletteTable:
    """The coded form of a bfloat16 table [n, k] (n a multiple of 32, k of 64)."""
    coded = encode(np.asarray(table)[None], 1)
    return CpuPaletteTable(coded.blocks, coded.exc_start, coded.exc, (int(table.shape[0]), int(table.shape[1])))


def matmul_nt(x: jax.Array, table: CpuPaletteTable) -> jax.Array:
    """x [..., k] @ table.T, in jfire_matmul_nt's order of sums (its bits on the decoded table)."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)
    out = jax.ffi.ffi_call(
        _target("jfire_palette_matmul_nt"), jax.ShapeDtypeStruct((rows.shape[0], table.shape[0]), jnp.float32)
    )(rows, table.blocks, table.exc_start, table.exc)
    return out.reshape(*lead, table.shape[0])


def matrix_dims(shape: tuple[int, ...], n_in: int) -> tuple[int, int]:
    """(k, n) of each layer of a stack [layers, in..., out...]: its inputs and outputs."""
    return math.prod(shape[1 : 1 + n_in]), math.prod(shape[1 + n_in :])


def fits(shape: tuple[int, ...], n_in: int) -> bool:
    """Whether a stack of this shape takes the coded form (whole blocks only)."""
    k, n = matrix_dims(shape, n_in)
    return len(shape) >= 3 and k % BLOCK_ROWS == 0 and n % BLOCK_COLS == 0


def _layers_k_n(stack: np.ndarray, n_in: int) -> tuple[tuple[int, ...], int, int, int]:
    """(shape, layers, k, n) of a stack the coded form takes; ValueError for one it does not."""
    shape = tuple(int(d) for d in stack.shape)
    if not fits(shape, n_in):
        raise ValueError(f"a stack of shape {shape} does not split into blocks of {BLOCK_ROWS} x {BLOCK_COLS}")
    return shape, shape[0], *matrix_dims(shape, n_in)


def encode(stack: np.ndarray, n_in: int) -> CpuPalette:
    """The coded form of a bfloat16 stack [layers, in..., out...] (on the host), by the kernels'
    library (`jfire_palette_encode`, one pass a layer: the default model's weights in about
    0.5 s against 7 s in numpy), else by `encode_reference`."""
    lib = cpu_matmul.native_library()
    if lib is None:
        return encode_reference(stack, n_in)
    shape, layers, k, n = _layers_k_n(stack, n_in)
    bits = np.ascontiguousarray(np.asarray(stack).view(np.uint16)).reshape(layers, k, n)
    count = (k // BLOCK_ROWS) * (n // BLOCK_COLS)
    blocks = np.empty((layers, count * BLOCK_BYTES), np.uint8)
    exc_start = np.empty((layers, count + 1), np.uint32)
    scratch = np.empty(k * n, np.uint32)
    fn = lib.jfire_palette_encode
    fn.restype = ctypes.c_int64
    found = []
    for layer in range(layers):
        got = fn(
            bits[layer].ctypes.data_as(ctypes.c_void_p),
            ctypes.c_int64(k),
            ctypes.c_int64(n),
            blocks[layer].ctypes.data_as(ctypes.c_void_p),
            exc_start[layer].ctypes.data_as(ctypes.c_void_p),
            scratch.ctypes.data_as(ctypes.c_void_p),
        )
        found.append(scratch[:got].copy())
    exc = np.zeros((layers, max(len(f) for f in found) + 1), np.uint32)
    for layer, f in enumerate(found):
        exc[layer, : len(f)] = f
    return CpuPalette(jnp.asarray(blocks), jnp.asarray(exc_start), jnp.asarray(exc), shape, n_in)


def encode_reference(stack: np.ndarray, n_in: int) -> CpuPalette:
    """`encode` in vectorised numpy: what the native encoder is held to (and the encoder where
    the library is unavailable)."""
    shape, layers, k, n = _layers_k_n(stack, n_in)
    bits = (
        np.ascontiguousarray(stack)
        .view(np.uint16)
        .reshape(layers, k // BLOCK_ROWS, BLOCK_ROWS, n // BLOCK_COLS, BLOCK_COLS)
    )
    bits = bits.transpose(0, 1, 3, 2, 4).reshape(layers, -1, BLOCK_ROWS * BLOCK_COLS)  # [layers, blocks, 2048]
    exponent = ((bits >> 7) & 0xFF).astype(np.uint8)
    raw = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    count = layers * bits.shape[1]
    # Each block's 16 commonest exponents (ties: the smaller exponent), and every exponent's code,
    # looked up by (block, exponent) as one int32 index into [blocks x 256] tables.
    key = np.arange(count, dtype=np.int32)[:, None] * 256 + exponent.reshape(count, -1)
    hist = np.bincount(key.reshape(-1), minlength=count * 256).reshape(count, 256)
    palette = np.argsort(-hist, axis=1, kind="stable")[:, :PALETTE].astype(np.uint8)
    code_of = np.full((count, 256), 255, np.uint8)  # 255: not in the block's palette
    np.put_along_axis(code_of, palette.astype(np.int64), np.arange(PALETTE, dtype=np.uint8)[None, :], axis=1)
    codes = code_of.reshape(-1)[key]
    missing = codes == 255
    codes[missing] = 0
    flat_exp = exponent.reshape(count, -1)
    # Codes of rows 8w .. 8w+7 of a column in word w, row j at bits 4 * (j % 8).
    nibbles = codes.reshape(count, 4, 8, BLOCK_COLS).astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))[:, None]
    words = np.bitwise_or.reduce(nibbles, axis=2)  # [count, 4, 64]
    blocks = np.concatenate(
        [palette, words.reshape(count, -1).view(np.uint8).reshape(count, -1), raw.reshape(count, -1)], axis=1
    ).reshape(layers, -1)
    # Exceptions per layer, block by block, each (row * 64 + column) << 8 | exponent.
    per_block = missing.sum(axis=1).reshape(layers, -1)
    exc_start = np.zeros((layers, per_block.shape[1] + 1), np.uint32)
    exc_start[:, 1:] = np.cumsum(per_block, axis=1)
    entries = int(exc_start[:, -1].max())
    exc = np.zeros((layers, entries + 1), np.uint32)
    block_of, pos = np.nonzero(missing)
    values = pos.astype(np.uint32) << 8 | flat_exp[block_of, pos].astype(np.uint32)
    layer_of = block_of // per_block.shape[1]
    first_of_layer = np.searchsorted(layer_of, np.arange(layers))
    exc[layer_of, np.arange(len(block_of)) - first_of_layer[layer_of]] = values
    return CpuPalette(jnp.asarray(blocks), jnp.asarray(exc_start), jnp.asarray(exc), shape, n_in)


def stacked_matmuls(x: jax.Array, stacks, layer) -> tuple[jax.Array, ...]:
    """x [..., k] @ stack[layer] for each coded stack (all with the same k), in one kernel call:
    outputs [..., out...]."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)
    shapes = tuple(jax.ShapeDtypeStruct((rows.shape[0], s.n), jnp.float32) for s in stacks)
    arrays = [a for s in stacks for a in (s.blocks, s.exc_start, s.exc)]
    outs = jax.ffi.ffi_call(_target("jfire_palette_matmul"), shapes)(
        rows, jnp.asarray(layer, jnp.int32).reshape(1), *arrays
    )
    return tuple(out.reshape(*lead, *s.shape[1 + s.n_in :]) for out, s in zip(outs, stacks))


def has_coded(tree) -> bool:
    """Whether a params tree holds coded stacks."""
    return any(
        isinstance(leaf, CpuPalette) for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, CpuPalette))
    )


def _target(name: str) -> str:
    """The FFI target of kernel `name`, its library loaded (the coded form has no other path)."""
    if not cpu_matmul.ready():
        raise RuntimeError("palette-coded weights need jfire's CPU kernels, which are unavailable here")
    return cpu_matmul.target(name)
