"""Layer weights that may be kept compressed on the device, decoded as the layer loop reaches them.

The model's layer scan asks `layer_slice` for layer `i` of a stacked tree; a leaf that is
`Compressed` or `Palette` (a checkpoint loaded with --keep-compressed) is decoded by its
kernel just before the layer runs, any other leaf is indexed. On a mesh a coded leaf is
`CodedBlocks`, one block per device, each decoded by its device; on a GPU a palette-coded linear
layer may be a `FusedPalette`, which the layer multiplies by coded. Kept beside the kernels,
not in checkpoint/, so the models never import the checkpoint code.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jfire.kernels.bf16_decode import Compressed, bf16_decode, bf16_decode_reference
from jfire.kernels.palette_matmul import Palette, palette_decode, palette_decode_reference, palette_matmul
from jfire.kernels.varying import shard_map_mesh

DECODERS = ("pallas", "pallas-interpret", "reference")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["coded"], meta_fields=["mesh", "block_axes", "spec"])
@dataclasses.dataclass(frozen=True)
class CodedBlocks:
    """A coded tensor on a mesh, as one coded block per device: the block of the tensor that
    device holds, coded on its own (`jfire.checkpoint.coded_shards` cuts them). Every array
    of `coded` leads with a block axis split over `block_axes` (pp first), so each device holds
    exactly its block; `coded.layout` is one block's. `spec` places the decoded tensor."""

    coded: Compressed | Palette
    mesh: jax.sharding.Mesh
    block_axes: tuple[str, ...]
    spec: P

    @property
    def nbytes(self) -> int:
        return self.coded.nbytes

    @property
    def depth(self) -> int:
        """Layers in one block: a stage's layers when the stack is split over pp."""
        return self.coded.layout.shape[0]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["coded"], meta_fields=["max_rows"])
@dataclasses.dataclass(frozen=True)
class FusedPalette:
    """A palette-coded linear layer stack that the layers multiply by coded: a product of up to
    `max_rows` rows of x is the fused matmul (each weight tile rebuilt in bf16 right before its
    dot, jfire.kernels.palette_matmul); a larger one (a prefill chunk) decodes the layer first,
    as any coded leaf. `max_rows` is chosen per matrix (`fused_rows`) and, being static, is part
    of every program's key."""

    coded: Palette
    max_rows: int

    @property
    def nbytes(self) -> int:
        return self.coded.nbytes


CODED = (Compressed, Palette, CodedBlocks, FusedPalette)


def default_decoder() -> str:
    """The Pallas kernel on a GPU; elsewhere the reference (plain jnp): the kernel in
    interpret mode decodes at a fifth of its speed on a CPU (the tests run it there)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def decode(c: Compressed | Palette | CodedBlocks | FusedPalette, decoder: str, unit=None) -> jax.Array:
    """The tensor (or one unit of it) in bf16, by the named decoder."""
    if isinstance(c, CodedBlocks):
        return decode_blocks(c, decoder, unit)
    if isinstance(c, FusedPalette):
        c = c.coded
    if decoder not in DECODERS:
        from jfire.errors import JfireError

        raise JfireError(f"unknown decoder {decoder!r}; use one of: {', '.join(DECODERS)}")
    if isinstance(c, Palette):
        if decoder == "reference":
            return palette_decode_reference(c, unit)
        return palette_decode(c, unit, interpret=decoder == "pallas-interpret")
    if decoder == "reference":
        return bf16_decode_reference(c, unit)
    if decoder == "pallas-interpret":
        return bf16_decode(c, unit, interpret=True, block_lanes=16384)  # few, wide programs: the grid is a loop on CPU
    return bf16_decode(c, unit)


def decode_blocks(b: CodedBlocks, decoder: str, unit=None) -> jax.Array:
    """The tensor (or one unit of it, a layer of a stage's layers) in bf16, placed by its spec:
    each device decodes its own block, in a shard_map over the mesh axes not already manual
    (inside the pipeline's, pp is)."""
    mesh = shard_map_mesh(b.mesh)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    free = tuple(a for a in b.block_axes if a not in manual)
    out = tuple(b.spec)[0 if unit is None else 1 :]
    out = P(*(_without(entry, manual) for entry in out))
    block_spec = jax.tree.map(lambda _: P(free or None), b.coded)

    # Every traced value enters as an argument (the unit may be a scan index).
    args = (b.coded,) if unit is None else (b.coded, jnp.asarray(unit, jnp.int32))

    def one(coded, *unit):
        coded = jax.tree.map(lambda a: a[0], coded)  # this device's block
        return decode(coded, decoder, *unit)

    return jax.shard_map(
        one,
        mesh=mesh,
        axis_names=frozenset(mesh.axis_names) - manual,
        in_specs=(block_spec,) + (P(),) * (len(args) - 1),
        out_specs=out,
        check_vma=False,
    )(*args)


def _without(entry, axes: set):
    """A PartitionSpec entry without the mesh axes in `axes` (None when none is left)."""
    names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    left = tuple(n for n in names if n not in axes)
    return None if not left else left[0] if len(left) == 1 else left


def has_compressed(tree) -> bool:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, CODED))
    return any(isinstance(leaf, CODED) for leaf in leaves)


def layer_slice(layers: dict, i, *, dtype=jnp.bfloat16, decoder: str | None = None) -> dict:
    """Layer `i` of a stacked layer tree whose leaves may be coded: what the layer
    loop's body needs, decoded just before it runs. `i` may be a traced scan index.

    The model's scan then carries the compressed tree as a constant and scans over layer
    ids only.
    """
    decoder = decoder or default_decoder()
    return jax.tree.map(
        lambda leaf: leaf_layer(leaf, i, dtype, decoder), layers, is_leaf=lambda x: isinstance(x, CODED)
    )


def leaf_layer(leaf, i, dtype, decoder: str | None = None) -> jax.Array:
    """Layer `i` of one stacked leaf: a coded leaf's decoded in `dtype`, a plain one's indexed."""
    if isinstance(leaf, CODED):
        return decode(leaf, decoder or default_decoder(), unit=i).astype(dtype)
    return jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False)


def has_fused(tree) -> bool:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, CODED))
    return any(isinstance(leaf, FusedPalette) for leaf in leaves)


def fused_matmul(x: jax.Array, w: FusedPalette, unit) -> jax.Array:
    """x [m, rows] @ layer `unit` of w, read coded: [m, cols] in x's dtype, summed in float32.
    Off a GPU the kernel runs in interpret mode (the tests)."""
    return palette_matmul(x, w.coded, unit, interpret=jax.default_backend() != "gpu", out_dtype=x.dtype)


# Rows of x at which `fused_rows` times the fused matmul against decoding the layer and XLA's dot.
FUSED_BUCKETS = (1, 8, 64, 256)


def fused_rows(p: Palette, dtype, repeats: int = 5) -> int:
    """The most rows of x (of FUSED_BUCKETS, 0 for none) up to which the fused matmul multiplies
    by layer 0 of `p` faster than decoding that layer and multiplying (XLA's dot), timed on the
    device: Unweight's per-matrix choice, taken at start-up. Assumes the fused path's lead
    shrinks as rows grow (it reads the weight once per 16 rows of x)."""
    import time

    if p.layout.tile_cols < 16:  # Triton's dot needs 16 columns; such tiles are never fused
        return 0
    decoder = default_decoder()
    fused = jax.jit(lambda x, p: fused_matmul(x, FusedPalette(p, 0), 0))
    decoded = jax.jit(lambda x, p: x @ decode(p, decoder, unit=0).reshape(p.layout.rows, p.layout.cols).astype(x.dtype))
    best = 0
    for rows in FUSED_BUCKETS:
        x = jnp.ones((rows, p.layout.rows), dtype)
        times = []
        for fn in (fused, decoded):
            fn(x, p).block_until_ready()
            start = time.perf_counter()
            for _ in range(repeats):
                out = fn(x, p)
            out.block_until_ready()
            times.append(time.perf_counter() - start)
        if times[0] >= times[1]:
            break
        best = rows
    return best
