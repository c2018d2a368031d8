"""Logical axis rules: how each named tensor dimension maps onto the mesh.

Model code names its dimensions (`ParamSpec.axes`); this one table turns names into mesh
axes. Tensor parallelism follows from it: attention heads and the MLP width split over tp
(column-parallel in, row-parallel out, so XLA inserts one all-reduce after each block),
the vocabulary splits over tp (embedding and LM head), layers split over pp.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jfire.errors import JfireError
from jfire.models.llama import LlamaConfig
from jfire.models.params import get_path, set_path

RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "dp",
    "layers": "pp",
    # The embedding and LM head live outside the pipeline stages: splitting the vocabulary
    # over pp as well as tp keeps every device's share of the weights even.
    "vocab": ("pp", "tp"),
    "q_heads": "tp",
    "kv_heads": "tp",
    "ffn": "tp",
    "experts": "ep",
    "embed": None,
    "head_dim": None,
    "sequence": None,
    "pages": None,
    "page_slots": None,
}

CACHE_AXES = ("layers", "kv_heads", "pages", "page_slots", "head_dim")


def partition_spec(axes: tuple[str, ...], mesh: jax.sharding.Mesh, shape: tuple[int, ...] | None = None) -> PartitionSpec:
    """The PartitionSpec for logically named dims; a mesh axis used twice raises, and a dim
    the mesh axis does not divide stays replicated."""
    out, used = [], set()
    for i, name in enumerate(axes):
        if name not in RULES:
            raise JfireError(f"logical axis {name!r} has no sharding rule")
        rule = RULES[name]
        mesh_axes = [a for a in ((rule,) if isinstance(rule, str) else rule or ()) if mesh.shape[a] > 1]
        for a in mesh_axes:
            if a in used:
                raise JfireError(f"logical axes {axes} map mesh axis {a!r} twice")
        ways = 1
        for a in mesh_axes:
            ways *= mesh.shape[a]
        if not mesh_axes or (shape is not None and shape[i] % ways):
            out.append(None)
            continue
        used.update(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
    return PartitionSpec(*out)


def param_shardings(cfg: LlamaConfig, mesh) -> dict:
    tree: dict = {}
    for spec in cfg.param_specs():
        set_path(tree, spec.name, NamedSharding(mesh, partition_spec(spec.axes, mesh, spec.shape)))
    return tree


def cache_sharding(cfg: LlamaConfig, mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(CACHE_AXES, mesh, (cfg.num_layers, cfg.num_kv_heads, 1, 1, 1)))


# -- KV heads when tp exceeds them ---------------------------------------------------------------


def kv_replication(cfg: LlamaConfig, tp: int) -> int:
    """How many times each KV head is repeated so every tp shard owns one (1 = none)."""
    return tp // cfg.num_kv_heads if tp > cfg.num_kv_heads else 1


def expand_kv_heads(cfg: LlamaConfig, params: dict, mesh) -> tuple[LlamaConfig, dict]:
    """With tp > KV heads, repeats each KV head so the heads split evenly over tp.

    Query head h uses KV head h // (H / KVH); after repeating each KV head r times in place,
    h // (H / (KVH * r)) names a copy of that same head, so attention is unchanged.
    """
    r = kv_replication(cfg, mesh.shape["tp"])
    if r == 1:
        return cfg, params
    wide = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)
    targets = param_shardings(wide, mesh)
    out = jax.tree.map(lambda x: x, params)
    for spec in wide.param_specs():
        if "kv_heads" not in spec.axes:
            continue
        axis = spec.axes.index("kv_heads")
        repeat = jax.jit(lambda x, axis=axis: jnp.repeat(x, r, axis=axis), out_shardings=get_path(targets, spec.name))
        set_path(out, spec.name, repeat(get_path(params, spec.name)))
    return wide, out


def place(host_params: dict, cfg: LlamaConfig, mesh) -> dict:
    """Host arrays onto the mesh: each device receives only its own shard."""
    shardings = param_shardings(cfg, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s), host_params, shardings)


def addressable_bytes(params: dict) -> dict:
    """Parameter bytes held by each device."""
    per_device: dict = {}
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return per_device
