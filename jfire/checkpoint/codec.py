"""The host side of lossless bf16 compression: choosing a layout, building the code, encoding.

The format and the decoders live in `jfire.kernels.bf16_decode`; this module writes that
format with vectorised numpy (a few seconds for a 135M-parameter model) and provides the
checksum every decoded tensor is checked against.
"""

from __future__ import annotations

import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from jfire.kernels.bf16_decode import CODE_BITS, SYMBOLS, Compressed, Layout

LANE_TARGET = 512  # symbols per lane at most: 16 bits of lane length per 257-512 values
PAYS_BELOW = 0.95  # a tensor is stored compressed only if that saves at least 5%
MIN_VALUES = 1 << 14  # and is this large: for norms and biases a decode costs more than it saves
CHUNK = 1 << 21  # values packed at a time (per thread), bounding the encoder's temporary memory


def as_bits(x: np.ndarray) -> np.ndarray:
    """The u16 bit patterns of a bf16 array (other float dtypes are cast to bf16 first)."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return x
    if x.dtype != ml_dtypes.bfloat16:
        x = x.astype(ml_dtypes.bfloat16)
    return x.view(np.uint16)


def exponents(bits: np.ndarray) -> np.ndarray:
    return (bits >> 7).astype(np.uint8)  # the cast drops the sign bit


def make_layout(
    shape, perm=None, unit_axes: int = 0, row_axes: int | None = None, lane_target: int = LANE_TARGET
) -> Layout:
    """A layout for `shape`: encode layout = transpose(perm) (default: as is), the first
    `unit_axes` (0 or 1) axes coded separately, the next `row_axes` (default: one, none for a
    vector) forming rows. Lanes per row: the fewest (a power of two) of <= lane_target values."""
    shape = tuple(int(d) for d in shape)
    perm = tuple(range(len(shape))) if perm is None else tuple(perm)
    if row_axes is None:
        row_axes = 1 if len(shape) - unit_axes >= 2 else 0
    cols = math.prod(shape[p] for p in perm[unit_axes + row_axes :])
    lanes = 1
    while -(-cols // lanes) > lane_target:
        lanes *= 2
    return Layout(shape=shape, perm=perm, unit_axes=unit_axes, row_axes=row_axes, lanes=lanes)


# -- the code -------------------------------------------------------------------------------------


def code_lengths(freq: np.ndarray, max_bits: int = CODE_BITS) -> np.ndarray:
    """Optimal prefix-code lengths no longer than max_bits (package-merge), u8 [256].

    The code is always complete (Kraft sum exactly 1), so the decode table has no holes: a
    lone symbol gets length 1 and an unused partner.
    """
    freq = np.asarray(freq, dtype=np.int64)
    present = [int(s) for s in np.nonzero(freq)[0]]
    lengths = np.zeros(SYMBOLS, np.uint8)
    if len(present) <= 1:
        lone = present[0] if present else 0
        lengths[[lone, (lone + 1) % SYMBOLS]] = 1
        return lengths
    leaves = sorted((int(freq[s]), (s,)) for s in present)
    items = list(leaves)
    for _ in range(max_bits - 1):
        packages = [(items[i][0] + items[i + 1][0], items[i][1] + items[i + 1][1]) for i in range(0, len(items) - 1, 2)]
        items = sorted(leaves + packages, key=lambda item: item[0])
    for _, symbols in items[: 2 * (len(present) - 1)]:
        for s in symbols:
            lengths[s] += 1
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical code values (u32 [256]) for code lengths: by (length, symbol), consecutive."""
    codes = np.zeros(SYMBOLS, np.uint32)
    code, prev = 0, 0
    for s in sorted(np.nonzero(lengths)[0], key=lambda s: (lengths[s], s)):
        code <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        codes[s] = code
        code += 1
    return codes


def kraft_complete(lengths: np.ndarray) -> bool:
    """True when the lengths describe a complete prefix code of at most CODE_BITS bits."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.max(initial=0) > CODE_BITS:
        return False
    return int(np.sum(np.where(lengths > 0, 1 << (CODE_BITS - lengths), 0))) == 1 << CODE_BITS


def unit_histograms(exps: np.ndarray, layout: Layout) -> np.ndarray:
    """Exponent counts [units, 256] of each separately coded unit; `exps` in encode layout."""
    per_unit = exps.reshape(layout.units, -1)
    return np.stack([np.bincount(per_unit[u], minlength=SYMBOLS) for u in range(layout.units)])


def entropy_bits(freq: np.ndarray) -> float:
    """Order-0 entropy, bits per symbol, of a histogram."""
    freq = np.asarray(freq, np.float64)
    p = freq[freq > 0] / max(freq.sum(), 1)
    return max(0.0, float(-(p * np.log2(p)).sum()))


# -- encoding -------------------------------------------------------------------------------------


def encode(x: np.ndarray, layout: Layout, workers: int | None = None) -> Compressed:
    """Compresses a bf16 tensor (or its u16 bit patterns) into `layout`. Numpy arrays out.

    Blocks of rows are packed on `workers` threads (default: one per CPU; numpy releases
    the GIL in the heavy steps)."""
    bits = as_bits(x)
    if tuple(bits.shape) != layout.shape:
        raise ValueError(f"tensor of shape {bits.shape} does not match the layout's {layout.shape}")
    units, rows, cols, lanes = layout.units, layout.rows, layout.cols, layout.lanes
    bits = np.ascontiguousarray(bits.transpose(layout.perm)).reshape(units, rows, cols)
    exps = exponents(bits)
    raw = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    lengths = np.stack([code_lengths(h) for h in unit_histograms(exps, layout)])
    # Each code left-aligned in a u32: the bits a value contributes from its bit offset on.
    aligned = np.stack([canonical_codes(l) << (32 - l.astype(np.uint32)) for l in lengths]).astype(np.uint32)
    # Stream order within a row: lane 0's columns (0, lanes, 2*lanes, ...), then lane 1's, ...
    order = (np.arange(lanes)[:, None] + lanes * np.arange(layout.steps)[None, :]).ravel()
    order = order[order < cols]
    lane_first = np.concatenate([[0], np.cumsum((cols - np.arange(lanes) + lanes - 1) // lanes)[:-1]])
    lane_bits = np.empty((units, rows, lanes), np.uint16)

    def block(task):
        u, a, b = task
        e = exps[u, a:b][:, order]
        length = np.take(lengths[u], e)
        lane_bits[u, a:b] = np.add.reduceat(length, lane_first, axis=1, dtype=np.int32)
        return _pack(np.take(aligned[u], e), length)

    step = max(1, CHUNK // max(cols, 1))
    tasks = [(u, a, min(a + step, rows)) for u in range(units) for a in range(0, rows, step)]
    with ThreadPoolExecutor(workers or os.cpu_count()) as pool:
        words = list(pool.map(block, tasks))
    payload = np.concatenate(words + [np.zeros(1, np.uint32)])  # + the guard word the decoders read past the end
    return Compressed(layout=layout, code_lengths=lengths, lane_bits=lane_bits, raw=raw, payload=payload)


def _pack(aligned: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Bit-packs rows of left-aligned codes [rows, n] (MSB first), each row from a new u32 word."""
    row_words = (length.sum(axis=1, dtype=np.int64) + 31) // 32
    pos = np.cumsum(length, axis=1, dtype=np.int64) - length
    pos += (32 * (np.cumsum(row_words) - row_words))[:, None]
    pos = pos.ravel()
    word, shift = pos >> 5, (pos & 31).astype(np.uint32)
    aligned = aligned.ravel()
    hi = aligned >> shift  # the part in the code's first word
    lo = (aligned << np.uint32(1)) << (np.uint32(31) - shift)  # the part that spills into the next word
    # OR together the codes that start in each word, then add what spills into the next word.
    first = np.flatnonzero(np.diff(word, prepend=-1))
    packed = np.zeros(int(row_words.sum()) + 1, np.uint32)
    packed[word[first]] = np.bitwise_or.reduceat(hi, first)
    packed[word[first] + 1] |= np.bitwise_or.reduceat(lo, first)
    return packed[:-1]


def maybe_encode(x: np.ndarray, layout: Layout) -> Compressed | None:
    """The compressed tensor, or None when compression does not pay (tiny or incompressible)."""
    if math.prod(layout.shape) < MIN_VALUES:
        return None
    c = encode(x, layout)
    return c if c.nbytes < PAYS_BELOW * 2 * math.prod(layout.shape) else None


# -- checksums ------------------------------------------------------------------------------------


def mix32(i):
    """murmur3's 32-bit finaliser on u32 indices (numpy or jax): a well-spread weight per index."""
    i = i ^ (i >> 16)
    i = i * np.uint32(0x85EBCA6B)
    i = i ^ (i >> 13)
    i = i * np.uint32(0xC2B2AE35)
    return i ^ (i >> 16)


def checksum(x: np.ndarray) -> int:
    """sum(bits[i] * (mix32(i) | 1)) mod 2**32 over the tensor in row-major order.

    A change to any one value always changes it (odd weights, |delta| < 2**16); sums over
    shards add up, so a device can check its own part. `jfire.checkpoint.compressed`
    computes the same on the device.
    """
    bits = as_bits(x).reshape(-1)
    total = np.uint32(0)
    with np.errstate(over="ignore"):
        for a in range(0, bits.size, CHUNK):
            idx = np.arange(a, min(a + CHUNK, bits.size), dtype=np.uint64).astype(np.uint32)
            total += np.sum(bits[a : a + CHUNK].astype(np.uint32) * (mix32(idx) | np.uint32(1)), dtype=np.uint32)
    return int(total)


# -- shards ---------------------------------------------------------------------------------------


def flat_ids(ranges, dims: tuple[int, ...]) -> np.ndarray:
    """Row-major flat indices, over axes of sizes `dims`, of the product of per-axis index
    ranges (one index, 0, for no axes)."""
    if not len(ranges):
        return np.zeros(1, np.int64)
    return np.ravel_multi_index(np.meshgrid(*ranges, indexing="ij"), dims).ravel()


def concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices starts[i] .. starts[i] + counts[i] - 1 of every i, in order."""
    return np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())


def shard(c: Compressed, index: tuple) -> Compressed:
    """The block tensor[index] (one slice per axis of the tensor, as a device's shard is
    described) as a compressed tensor of its own, decodable without the rest.

    The block must take whole rows: only unit and row axes may be sliced, columns in full.
    Its rows' words are copied out of the payload (each row starts on a word, so no bits
    move) and its lane lengths, raw bytes and code tables are sliced alongside.
    """
    lay = c.layout
    index = tuple(index) + (slice(None),) * (len(lay.shape) - len(index))
    ranges = [range(*s.indices(n)) for s, n in zip(index, lay.shape)]
    enc = [ranges[p] for p in lay.perm]
    u, k = lay.unit_axes, lay.row_axes
    if any(len(r) != n for r, n in zip(enc[u + k :], lay.enc_shape[u + k :])):
        raise ValueError("a shard must take whole rows: only the unit and row axes may be sliced")
    units = np.asarray(enc[0]) if u else np.zeros(1, np.int64)
    rows = flat_ids(enc[u : u + k], lay.enc_shape[u : u + k])
    lane_bits = np.asarray(c.lane_bits)
    row_words = (lane_bits.astype(np.int64).sum(axis=-1) + 31) // 32  # [units, rows]
    row_start = (np.cumsum(row_words) - row_words.ravel()).reshape(row_words.shape)
    starts, counts = row_start[np.ix_(units, rows)].ravel(), row_words[np.ix_(units, rows)].ravel()
    words = concat_ranges(starts, counts)
    payload = np.concatenate([np.asarray(c.payload)[words], np.zeros(1, np.uint32)])
    shape = tuple(len(r) for r in ranges)
    return Compressed(
        layout=dataclasses.replace(lay, shape=shape),
        code_lengths=np.asarray(c.code_lengths)[units],
        lane_bits=lane_bits[np.ix_(units, rows)],
        raw=np.asarray(c.raw)[np.ix_(units, rows)],
        payload=payload,
    )
