"""Layer weights that may be kept compressed on the device, decoded as the layer loop reaches them.

The model's layer scan asks `layer_slice` for layer `i` of a stacked tree; a leaf that is
`Compressed` or `Palette` (a checkpoint loaded with --keep-compressed) is decoded by its
kernel just before the layer runs, any other leaf is indexed. Kept beside the kernel, not in checkpoint/,
so the models never import the checkpoint code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfire.kernels.bf16_decode import Compressed, bf16_decode, bf16_decode_reference
from jfire.kernels.palette_matmul import Palette, palette_decode, palette_decode_reference

DECODERS = ("pallas", "pallas-interpret", "reference")
CODED = (Compressed, Palette)


def default_decoder() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "pallas-interpret"


def decode(c: Compressed | Palette, decoder: str, unit=None) -> jax.Array:
    """The tensor (or one unit of it) in bf16, by the named decoder."""
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

    def one(leaf):
        if isinstance(leaf, CODED):
            return decode(leaf, decoder, unit=i).astype(dtype)
        return jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False)

    return jax.tree.map(one, layers, is_leaf=lambda x: isinstance(x, CODED))
