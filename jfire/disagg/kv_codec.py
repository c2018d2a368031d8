"""Lossless exponent coding of KV cache pages on the wire (a deployment's `[transfer] compress`).

A page array's values are coded in tiles: a tile is its last two axes (one layer's and one
head's [page_slots, head_dim] block, or a latent cache's [page_slots, latent]). A value's
8-bit exponent becomes a 4-bit code against the tile's largest exponent `top`:

    0..13  the exponent is top - code
    14     the exponent is 0 (zeros and subnormals: a last page's unfilled slots are zeros)
    15     an escape: the exponent is the tile's next escape byte

Sign and mantissa travel as they are: one byte for bfloat16, three for float32. One coded tile
is a uint8 row: [top, cap escape bytes, codes two to a byte, sign-and-mantissa bytes], kept as
a [1, width] block so a coded page has the axes of a page (and shards as one). A
bfloat16 tile of 16 x 64 values takes 1 + 16 + 512 + 1024 bytes against 2048 (0.758); float32
0.879. Every row has the same width, so the transfer programs keep fixed shapes.

Why a window under the largest exponent, not a palette of the commonest ones: one max per
tile finds it (no histogram), and keys and values of a head sit within 2^14 of their largest
but for rare tiny values, which the escapes take. A tile holding more than `cap` of them cannot
be coded: `encode` says so, and the sender sends that transfer raw.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ZERO_CODE, ESCAPE_CODE = 14, 15
WINDOW = 14  # exponents top - 13 .. top have codes of their own
ESCAPE_SHARE = 64  # a tile may hold one escape per this many values (the default model's KV: at most 6 in 1024)


def supported(dtype) -> bool:
    """Whether values of `dtype` can be coded: floats with an 8-bit exponent (bfloat16, float32)."""
    dtype = jnp.dtype(dtype)
    return dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _format(dtype) -> tuple[int, int, object]:
    """(mantissa bits, sign-and-mantissa bytes, the unsigned type of the same width)."""
    mantissa = jnp.finfo(dtype).nmant
    unsigned = {2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]
    return mantissa, (mantissa + 1 + 7) // 8, unsigned


def escape_capacity(tile_values: int) -> int:
    return max(1, tile_values // ESCAPE_SHARE)


def coded_width(tile_shape: tuple[int, ...], dtype) -> int:
    """Bytes of one coded tile of `tile_shape` values."""
    values = math.prod(tile_shape)
    return 1 + escape_capacity(values) + (values + 1) // 2 + values * _format(dtype)[1]


def coded_shape(page_shape: tuple[int, ...], dtype) -> tuple[int, ...]:
    """A coded page: its tiles' leading axes, then one [1, coded_width] row of bytes each."""
    return tuple(page_shape[:-2]) + (1, coded_width(tuple(page_shape[-2:]), dtype))


def encode(x) -> tuple[jax.Array, jax.Array]:
    """(x coded: uint8 [..., 1, coded_width], whether some tile has too many escapes to be coded).
    Works on any leading axes (a stack of pages codes page by page)."""
    mantissa, rest_bytes, unsigned = _format(x.dtype)
    lead, values = x.shape[:-2], x.shape[-2] * x.shape[-1]
    cap, rows = escape_capacity(values), math.prod(lead)
    bits = jax.lax.bitcast_convert_type(x, unsigned).reshape(rows, values).astype(jnp.uint32)
    exponent = (bits >> mantissa) & 0xFF
    rest = ((bits >> 8) & (1 << mantissa)) | (bits & ((1 << mantissa) - 1))
    top = jnp.max(exponent, axis=-1, keepdims=True)
    below = top - exponent
    code = jnp.where(exponent == 0, ZERO_CODE, jnp.where(below < WINDOW, below, ESCAPE_CODE))
    escaped = code == ESCAPE_CODE
    # Where each tile's first cap escapes are: binary searches in the running count of
    # escapes (a scatter of every value into the list took 4 times as long on a CPU).
    count = jnp.cumsum(escaped, axis=-1, dtype=jnp.int32)
    wanted = jnp.arange(1, cap + 1, dtype=jnp.int32)
    where = jax.vmap(lambda c: jnp.searchsorted(c, wanted, method="scan_unrolled"))(count)
    found = jnp.take_along_axis(exponent, jnp.minimum(where, values - 1), axis=-1)
    escapes = jnp.where(where < values, found, 0)
    code = code.astype(jnp.uint8)
    if values % 2:
        code = jnp.pad(code, ((0, 0), (0, 1)))
    pairs = code.reshape(rows, -1, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    rest = jnp.stack([(rest >> (8 * i)).astype(jnp.uint8) for i in range(rest_bytes)], axis=-1).reshape(rows, -1)
    byte = [top.astype(jnp.uint8), escapes.astype(jnp.uint8)]
    coded = jnp.concatenate([*byte, packed, rest], axis=-1)
    overflow = jnp.any(count[:, -1] > cap)
    return coded.reshape(lead + (1, coded.shape[-1])), overflow


def decode(coded, tile_shape: tuple[int, ...], dtype):
    """The values `encode` coded: [..., 1, coded_width] uint8 -> [..., *tile_shape] of dtype."""
    mantissa, rest_bytes, unsigned = _format(dtype)
    lead, values = coded.shape[:-2], math.prod(tile_shape)
    cap, rows = escape_capacity(values), math.prod(lead)
    row = coded.reshape(rows, coded.shape[-1])
    top, escapes = row[:, :1].astype(jnp.uint32), row[:, 1 : 1 + cap].astype(jnp.uint32)
    packed = row[:, 1 + cap : 1 + cap + (values + 1) // 2]
    rest_parts = row[:, 1 + cap + (values + 1) // 2 :].reshape(rows, values, rest_bytes).astype(jnp.uint32)
    code = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(rows, -1)[:, :values].astype(jnp.uint32)
    escaped = code == ESCAPE_CODE
    rank = jnp.clip(jnp.cumsum(escaped, axis=-1) - 1, 0, cap - 1)
    exponent = jnp.where(
        code == ZERO_CODE, 0, jnp.where(escaped, jnp.take_along_axis(escapes, rank, axis=-1), top - code)
    )
    rest = rest_parts[..., 0]
    for i in range(1, rest_bytes):
        rest = rest | (rest_parts[..., i] << (8 * i))
    bits = (((rest >> mantissa) & 1) << (mantissa + 8)) | (exponent << mantissa) | (rest & ((1 << mantissa) - 1))
    return jax.lax.bitcast_convert_type(bits.astype(unsigned), dtype).reshape(lead + tuple(tile_shape))
