"""The declaration every parameter is read from: shape, logical axes, source names, init.

Init, `eval_shape`, loading, conversion and sharding all walk the same `ParamSpec` tuple a
model config returns, so a new tensor is declared in exactly one place.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str  # dotted path in the params tree, e.g. "layers.wq"
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per dim
    hf: str | None  # name in a HF checkpoint ({i} = layer, {e} = expert) — stored [out, in] for linears
    gguf: str | None  # name in a GGUF file ({i} = layer)
    n_in: int | None = None  # linear layers: how many leading (per-layer) dims are inputs
    init: str = "normal"  # "normal", "ones" or "zeros"
    flat_source: bool = True  # non-linears (norms, biases) are vectors in HF; the embedding is not
    first_layer: int = 0  # per-layer params: the model layer of this stack's first entry
    layer_step: int = 1  # per-layer params: model layers between entries (a periodic segment's period)
    per_expert: bool = False  # the source holds one tensor per expert ({e}), stacked after `layers`
    take: tuple[int, int] | None = None  # a slice [start, stop) of the source's last axis (fused tensors)
    source_full: int | None = None  # with `take`: the size of that last axis in the source
    gguf_rotary_heads: int | None = None  # llama.cpp permutes Q/K rows for rotary: heads to undo it
    dtype: str | None = (
        None  # stored in this dtype whatever the model's (packed int4 words, FP8 experts, a float32 bias)
    )

    @property
    def per_layer(self) -> bool:
        return self.axes[0] in ("layers", "layers_unpiped")

    @property
    def layers(self) -> range:
        """The model layers this (per-layer) param holds."""
        return range(self.first_layer, self.first_layer + self.layer_step * self.shape[0], self.layer_step)

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """One source tensor's worth in this param's layout: one layer's (and expert's) slice."""
        return self.shape[(1 if self.per_layer else 0) + (1 if self.per_expert else 0) :]

    @property
    def source_shape(self) -> tuple[int, ...]:
        """The shape of one source tensor (one layer's, or one expert's, slice) as HF stores it."""
        shape = self.unit_shape
        if self.n_in is None:
            if self.take is not None:
                return (*shape[:-1], self.source_full)
            return (math.prod(shape),) if self.flat_source else shape
        return (math.prod(shape[self.n_in :]), math.prod(shape[: self.n_in]))

    def from_source(self, tensor: np.ndarray) -> np.ndarray:
        """One source tensor (already shape-checked) in this param's per-unit layout."""
        if self.take is not None:
            tensor = tensor[..., self.take[0] : self.take[1]]
        if self.n_in is not None:
            tensor = tensor.T
        return tensor.reshape(self.unit_shape)


def spec_dtype(spec: ParamSpec, model_dtype) -> np.dtype:
    """The dtype a param is held in: its own, or the model's."""
    return np.dtype(spec.dtype or model_dtype)


def set_path(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def get_path(tree: dict, dotted: str):
    for p in dotted.split("."):
        tree = tree[p]
    return tree


def abstract_params(specs, dtype) -> dict:
    """A tree of ShapeDtypeStructs: what restore and AOT compilation need without any weights."""
    tree: dict = {}
    for s in specs:
        set_path(tree, s.name, jax.ShapeDtypeStruct(s.shape, spec_dtype(s, dtype)))
    return tree


def init_params(specs, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random weights for tests and benchmarks (normal(0, scale) matrices, unit norms; packed
    int4 words of random nibbles and FP8 codes, with scales that give them about the same spread)."""
    tree: dict = {}
    for i, s in enumerate(specs):
        k = jax.random.fold_in(key, i)
        if s.init == "int4":
            value = jax.lax.bitcast_convert_type(jax.random.bits(k, s.shape, jnp.uint32), jnp.int32)
        elif s.init == "int4_scale":
            value = jnp.full(s.shape, scale / 4.6, spec_dtype(s, dtype))  # nibbles - 8 have std ~4.6
        elif s.init == "fp8":
            # FP8 codes of about unit spread; their block scales bring them to `scale`.
            value = jax.random.normal(k, s.shape, jnp.float32).astype(jnp.float8_e4m3fn)
        elif s.init == "fp8_scale":
            value = jnp.full(s.shape, scale, spec_dtype(s, dtype))
        elif s.init == "ones":
            value = jnp.ones(s.shape, spec_dtype(s, dtype))
        elif s.init == "zeros":
            value = jnp.zeros(s.shape, spec_dtype(s, dtype))
        else:
            value = (scale * jax.random.normal(k, s.shape, jnp.float32)).astype(spec_dtype(s, dtype))
        set_path(tree, s.name, value)
    return tree
