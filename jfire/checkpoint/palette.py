"""The host side of the palette codec: per-tile exponent histograms, the choice of k, encoding.

The format and the decoders (reference, Pallas, the fused matmul) live in
`jfire.kernels.palette_matmul`; this module writes that format with vectorised numpy.
"""

from __future__ import annotations

import math

import numpy as np

from jfire.checkpoint.codec import CHUNK, MIN_VALUES, PAYS_BELOW, as_bits, concat_ranges, exponents, flat_ids
from jfire.kernels.palette_matmul import GROUP, TILE_COLS, TILE_ROWS, Palette, PaletteLayout

K_CHOICES = tuple(range(1, 9))  # code bits tried per tensor; the smallest stored size wins


def make_layout(
    shape, unit_axes: int = 0, row_axes: int | None = None, k: int = 3, tile_rows=TILE_ROWS, tile_cols=TILE_COLS
) -> PaletteLayout:
    """A layout for `shape`: the first `unit_axes` axes are units, the next `row_axes` (default:
    one) rows, the rest columns. Tiles shrink to the tensor where it is smaller (rows to a
    multiple of 32, both powers of two); narrow ones grow taller, to keep tile_rows x
    tile_cols values each (a vector is one column of tiles)."""
    shape = tuple(int(d) for d in shape)
    if row_axes is None:
        row_axes = 1 if len(shape) > unit_axes else 0
    rows = math.prod(shape[unit_axes : unit_axes + row_axes])
    cols = math.prod(shape[unit_axes + row_axes :])
    values = tile_rows * tile_cols
    tile_cols = min(tile_cols, 1 << max(0, cols - 1).bit_length())
    tile_rows = min(values // tile_cols, max(GROUP, 1 << (rows - 1).bit_length()))
    return PaletteLayout(shape, unit_axes, row_axes, k, tile_rows, tile_cols)


def _matrix(bits: np.ndarray, lay: PaletteLayout) -> np.ndarray:
    if tuple(bits.shape) != lay.shape:
        raise ValueError(f"tensor of shape {bits.shape} does not match the layout's {lay.shape}")
    return bits.reshape(lay.units * lay.rows, lay.cols)


def _tile_ids(first_row: int, n_rows: int, lay: PaletteLayout) -> np.ndarray:
    """Tile index (unit, row tile, col tile, flattened) of every value of rows
    first_row .. first_row + n_rows of the [units * rows, cols] view: [n_rows, cols] int64."""
    g = np.arange(first_row, first_row + n_rows)
    row_tile = (g // lay.rows) * lay.row_tiles + (g % lay.rows) // lay.tile_rows
    return row_tile[:, None] * lay.col_tiles + (np.arange(lay.cols) // lay.tile_cols)[None, :]


def _chunks(lay: PaletteLayout):
    step = max(1, CHUNK // max(lay.cols, 1))
    total = lay.units * lay.rows
    return [(a, min(a + step, total)) for a in range(0, total, step)]


def tile_histograms(bits: np.ndarray, lay: PaletteLayout) -> np.ndarray:
    """Exponent counts of every tile: int64 [units * tiles, 256]."""
    exps = exponents(_matrix(as_bits(bits), lay))
    hist = np.zeros(lay.units * lay.tiles * 256, np.int64)
    for a, b in _chunks(lay):
        idx = _tile_ids(a, b - a, lay) * 256 + exps[a:b]
        hist += np.bincount(idx.ravel(), minlength=hist.size)
    return hist.reshape(-1, 256)


def stored_bytes(lay: PaletteLayout, exceptions: int) -> int:
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in lay.shapes(exceptions).values())


def exceptions_for(hist: np.ndarray, k: int) -> int:
    """Values outside their tile's 2**k commonest exponents."""
    top = -np.sort(-hist, axis=1)[:, : 1 << k]
    return int(hist.sum() - top.sum())


def choose_k(hist: np.ndarray, lay: PaletteLayout) -> int:
    """The code width with the smallest stored size (palettes, codes and exceptions counted)."""
    sizes = {k: stored_bytes(_with_k(lay, k), exceptions_for(hist, k)) for k in K_CHOICES}
    return min(sizes, key=lambda k: (sizes[k], k))


def _with_k(lay: PaletteLayout, k: int) -> PaletteLayout:
    return PaletteLayout(lay.shape, lay.unit_axes, lay.row_axes, k, lay.tile_rows, lay.tile_cols)


def encode(x: np.ndarray, layout: PaletteLayout, k: int | None = None) -> Palette:
    """Codes a bf16 tensor (or its u16 bit patterns) in `layout`, with k bits (default: the
    k giving the smallest size; layout.k is then ignored). Numpy arrays out."""
    bits = _matrix(as_bits(x), layout)
    hist = tile_histograms(bits.reshape(layout.shape), layout)
    lay = _with_k(layout, k or choose_k(hist, layout))
    entries = lay.entries
    # Each tile's palette: its commonest exponents, most common first (ties: lower exponent).
    order = np.argsort(-hist, axis=1, kind="stable")
    palette = order[:, :entries].astype(np.uint8)
    present = np.take_along_axis(hist, order[:, :entries], axis=1) > 0
    lookup = np.full((hist.shape[0], 256), -1, np.int16)  # exponent -> code, -1 for an exception
    np.put_along_axis(lookup, order[:, :entries], np.where(present, np.arange(entries), -1).astype(np.int16), axis=1)

    exps = exponents(bits)
    raw = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    rows_padded = -(-lay.rows // GROUP) * GROUP
    code = np.zeros((lay.units, rows_padded, lay.cols), np.uint8)
    flat_code = code[:, : lay.rows].reshape(lay.units * lay.rows, lay.cols) if lay.rows == rows_padded else None
    exc_tile, exc_pos, exc_exp = [], [], []
    for a, b in _chunks(lay):
        tile = _tile_ids(a, b - a, lay)
        c = lookup.reshape(-1)[tile * 256 + exps[a:b]]
        miss = c < 0
        if flat_code is not None:
            flat_code[a:b] = np.where(miss, 0, c)
        else:
            g = np.arange(a, b)
            code[g // lay.rows, g % lay.rows] = np.where(miss, 0, c)
        r, col = np.nonzero(miss)
        g = a + r
        exc_tile.append(tile[r, col])
        exc_pos.append(((g % lay.rows) % lay.tile_rows) * lay.tile_cols + col % lay.tile_cols)
        exc_exp.append(exps[a:b][r, col])
    tiles, pos, exp = (np.concatenate(v) for v in (exc_tile, exc_pos, exc_exp))
    order = np.lexsort((pos, tiles))  # by tile, then position
    tiles, pos, exp = tiles[order], pos[order], exp[order]
    exc_start = np.concatenate([[0], np.cumsum(np.bincount(tiles, minlength=lay.units * lay.tiles))])
    return Palette(
        layout=lay,
        codes=pack_codes(code, lay.k),
        raw=raw.reshape(lay.units, lay.rows, lay.cols),
        palette=palette.reshape(lay.units, lay.row_tiles, lay.col_tiles, entries),
        exc_start=exc_start.astype(np.uint32),
        exc_pos=np.concatenate([pos, [0]]).astype(np.uint16),  # + the guard entry
        exc_exp=np.concatenate([exp, [0]]).astype(np.uint8),
    )


def pack_codes(code: np.ndarray, k: int) -> np.ndarray:
    """u8 codes [n, rows (a multiple of 32), cols] into u32 words [n, rows / 32 * k, cols]: a
    column's rows 32g .. 32g+31 as one little-endian 32k-bit integer in words g*k .. g*k+k-1."""
    n, rows, cols = code.shape
    grouped = code.reshape(n, rows // GROUP, GROUP, cols)
    words = np.zeros((n, rows // GROUP, k, cols), np.uint32)
    for j in range(GROUP):
        w, s = divmod(k * j, 32)
        v = grouped[:, :, j].astype(np.uint32)
        words[:, :, w] |= v << np.uint32(s)
        if s + k > 32:
            words[:, :, w + 1] |= v >> np.uint32(32 - s)
    return words.reshape(n, rows // GROUP * k, cols)


def maybe_encode(x: np.ndarray, layout: PaletteLayout) -> Palette | None:
    """The coded tensor, or None when coding does not pay (tiny or incompressible)."""
    if math.prod(layout.shape) < MIN_VALUES:
        return None
    p = encode(x, layout)
    return p if p.nbytes < PAYS_BELOW * 2 * math.prod(layout.shape) else None


def shard(p: Palette, index: tuple) -> Palette | None:
    """The block tensor[index] (one slice per axis, as a device's shard is described) as a
    palette tensor of its own, decodable without the rest; None where the block cuts a tile
    (a shard boundary inside a tile's rows or columns).

    Whole tiles carry their palettes, codes, raw bytes and exception lists with them (an
    exception's position is within its tile), so every array is sliced and only the exception
    offsets are counted again for the block's tiles."""
    lay = p.layout
    index = tuple(index) + (slice(None),) * (len(lay.shape) - len(index))
    ranges = [np.arange(*s.indices(n)) for s, n in zip(index, lay.shape)]
    u, r = lay.unit_axes, lay.unit_axes + lay.row_axes
    units = flat_ids(ranges[:u], lay.shape[:u])
    rows = flat_ids(ranges[u:r], lay.shape[u:r])
    cols = flat_ids(ranges[r:], lay.shape[r:])
    row_tiles = _whole_tiles(rows, lay.rows, lay.tile_rows)
    col_tiles = _whole_tiles(cols, lay.cols, lay.tile_cols)
    if row_tiles is None or col_tiles is None:
        return None
    groups = np.unique(rows // GROUP)
    code_rows = (groups[:, None] * lay.k + np.arange(lay.k)[None, :]).ravel()
    unit_rows = units[:, None, None] * lay.row_tiles + row_tiles[None, :, None]
    tile_ids = (unit_rows * lay.col_tiles + col_tiles[None, None, :]).ravel()  # the block's tiles, in order
    start = np.asarray(p.exc_start).astype(np.int64)
    first, count = start[tile_ids], np.diff(start)[tile_ids]
    entries = concat_ranges(first, count)
    block = PaletteLayout(
        tuple(len(a) for a in ranges), lay.unit_axes, lay.row_axes, lay.k, lay.tile_rows, lay.tile_cols
    )
    return Palette(
        layout=block,
        codes=np.asarray(p.codes)[np.ix_(units, code_rows, cols)],
        raw=np.asarray(p.raw)[np.ix_(units, rows, cols)],
        palette=np.asarray(p.palette)[np.ix_(units, row_tiles, col_tiles)],
        exc_start=np.concatenate([[0], np.cumsum(count)]).astype(np.uint32),
        exc_pos=np.concatenate([np.asarray(p.exc_pos)[entries], [0]]).astype(np.uint16),
        exc_exp=np.concatenate([np.asarray(p.exc_exp)[entries], [0]]).astype(np.uint8),
    )


def _whole_tiles(ids: np.ndarray, n: int, tile: int) -> np.ndarray | None:
    """The tiles (of `tile` along an axis of `n`) that sorted `ids` cover whole, in order, or
    None when `ids` are not exactly those tiles' indices."""
    tiles = np.unique(ids // tile)
    whole = np.concatenate([np.arange(t * tile, min(n, t * tile + tile)) for t in tiles])
    return tiles if np.array_equal(whole, ids) else None
