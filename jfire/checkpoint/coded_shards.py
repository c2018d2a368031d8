"""Coded tensors on a mesh: each device receives, keeps and decodes only its own block.

A device's shard of a weight is a block of whole units and rows (Huffman: docs/compression.md
"Shards") or, for a palette tensor whose shard boundaries fall between tiles, of whole tiles.
`blocks_of` finds the distinct blocks of a tensor under its sharding; `cut` codes each on its
own from the stored tensor (slicing, no decoding) and `place` stacks them, padded to one size,
into arrays that lead with a block axis split over the mesh axes that split the tensor, so
each device's memory holds exactly its block (`CodedBlocks`). Decoding is a shard_map in which
every device decodes the block it holds (`jfire.kernels.layer_weights.decode_blocks`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfire.checkpoint import codec, palette
from jfire.kernels.bf16_decode import Compressed
from jfire.kernels.layer_weights import CodedBlocks
from jfire.kernels.palette_matmul import Palette


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The distinct blocks of one tensor under its sharding: `axes`, the mesh axes that split
    it (pp first, then in the mesh's order), number them row-major; `index[b]` is block b's
    slice of the tensor."""

    axes: tuple[str, ...]
    index: tuple[tuple[slice, ...], ...]


def blocks_of(sharding: NamedSharding, shape: tuple[int, ...]) -> Blocks:
    mesh = sharding.mesh
    used = {
        a for entry in sharding.spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))
    }
    axes = tuple(sorted((a for a in used if mesh.shape[a] > 1), key=lambda a: (a != "pp", mesh.axis_names.index(a))))
    sizes = [mesh.shape[a] for a in axes]
    index: dict[int, tuple[slice, ...]] = {}
    for device, where in sharding.devices_indices_map(tuple(shape)).items():
        coords = dict(zip(mesh.axis_names, np.argwhere(mesh.devices == device)[0]))
        block = int(np.ravel_multi_index([coords[a] for a in axes], sizes)) if axes else 0
        index.setdefault(block, where)
    return Blocks(axes, tuple(index[b] for b in range(len(index))))


def cut(coded: Compressed | Palette, blocks: Blocks) -> list | None:
    """Each block coded on its own (host arrays), or None when a block cannot be cut out of
    this tensor's code (a palette shard boundary inside a tile)."""
    if isinstance(coded, Compressed):
        return [codec.shard(coded, index) for index in blocks.index]
    out = [palette.shard(coded, index) for index in blocks.index]
    return None if any(b is None for b in out) else out


def place(pieces: list, blocks: Blocks, sharding: NamedSharding) -> CodedBlocks:
    """The blocks on the mesh, stacked on a leading block axis split over `blocks.axes`; the
    arrays of variable length (a Huffman payload, a palette exception list) are zero-padded to
    the longest, to a power of two, so equal layouts share compiled decoders. Each device is
    sent only its own block."""
    first = pieces[0]
    if isinstance(first, Compressed):
        words = 1 << (max(p.payload.shape[0] for p in pieces) - 1).bit_length()
        pieces = [dataclasses.replace(p, payload=_pad(p.payload, words)) for p in pieces]
    else:
        room = 1 << max(p.exceptions for p in pieces).bit_length()
        pieces = [dataclasses.replace(p, exc_pos=_pad(p.exc_pos, room + 1), exc_exp=_pad(p.exc_exp, room + 1))
                  for p in pieces]  # fmt: skip
    stacked = jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *pieces)
    where = NamedSharding(sharding.mesh, P(blocks.axes or None))
    on_mesh = jax.tree.map(lambda a: jax.device_put(a, where), stacked)
    return CodedBlocks(on_mesh, sharding.mesh, blocks.axes, sharding.spec)


def _pad(a, n: int) -> np.ndarray:
    a = np.asarray(a)
    return np.concatenate([a, np.zeros(n - a.shape[0], a.dtype)])
