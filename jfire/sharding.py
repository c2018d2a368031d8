"""Logical axis rules: how each named tensor dimension maps onto the mesh.

Model code names its dimensions (`ParamSpec.axes`); this one table turns names into mesh
axes. Tensor parallelism follows from it: attention heads and the MLP width split over tp
(column-parallel in, row-parallel out, so XLA inserts one all-reduce after each block),
the vocabulary splits over tp (embedding and LM head), layers split over pp, experts over ep.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jfire.errors import JfireError
from jfire.models.family import Family
from jfire.models.params import get_path, set_path

RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "dp",
    "layers": "pp",
    # Layers run outside the pipeline on every stage (a family's few odd leading layers).
    "layers_unpiped": None,
    # The embedding and LM head live outside the pipeline stages: splitting the vocabulary
    # over pp as well as tp keeps every device's share of the weights even.
    "vocab": ("pp", "tp"),
    "q_heads": "tp",
    "kv_heads": "tp",
    "ffn": "tp",
    "experts": "ep",
    # A router's output axis: every expert-parallel shard scores all experts.
    "experts_replicated": None,
    "embed": None,
    "head_dim": None,
    "sequence": None,
    "pages": None,
    "page_slots": None,
    # Multi-head latent attention: the latent has no head axis, so its pages are split over
    # the devices of a stage instead (sequence-sharded; jfire.models.mla).
    "latent_pages": ("ep", "tp"),
    "latent": None,
    "mla_head_dim": None,
    # Projections whose output every device needs whole (the latent, the router scores) split
    # over their input, with one all-reduce of a small output; the low-rank query splits over
    # its rank and is gathered before the head-split q_b.
    "embed_split": "tp",
    "q_lora": "tp",
    "q_lora_in": None,
    # Packed int4 experts ([experts, out, in / 8] words, [experts, out, in / group] scales):
    # the ffn axis splits over tp whether it is the output or the packed input.
    "embed_packed": None,
    "embed_groups": None,
    "ffn_packed": "tp",
    "ffn_groups": "tp",
    # FP8 experts' block scales ([experts, out / 128, in / 128]) split as the weights they scale.
    "embed_blocks": None,
    "ffn_blocks": "tp",
}


def partition_spec(
    axes: tuple[str, ...], mesh: jax.sharding.Mesh, shape: tuple[int, ...] | None = None
) -> PartitionSpec:
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


def param_shardings(cfg: Family, mesh) -> dict:
    tree: dict = {}
    for spec in cfg.param_specs():
        set_path(tree, spec.name, NamedSharding(mesh, partition_spec(spec.axes, mesh, spec.shape)))
    return tree


def cache_shardings(cfg: Family, mesh) -> dict:
    """Each cache array's sharding, from its declared axes. A pages axis that is split (MLA's
    `latent_pages`) needs a page count that `page_multiple` divides; the engine rounds to it."""
    n = mesh.devices.size
    return {c.name: NamedSharding(mesh, partition_spec(c.axes, mesh, c.shape(n, 1))) for c in cfg.cache_specs()}


def page_multiple(cache_shardings: dict, cfg: Family) -> int:
    """The number of pages must be a multiple of this: how many ways any cache array splits
    its pages axis (1 for the head-split KV caches)."""
    ways = 1
    for c in cfg.cache_specs():
        spec = cache_shardings[c.name].spec
        axis = c.pages_axis
        if axis < len(spec) and spec[axis] is not None:
            names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
            ways = max(ways, int(np.prod([cache_shardings[c.name].mesh.shape[a] for a in names])))
    return ways


# -- adapting to the tensor-parallel width --------------------------------------------------------


def adapt_to_mesh(cfg: Family, params: dict, mesh) -> tuple[Family, dict, int]:
    """(config, params, r) for the mesh's tp width: where the family repeats its cache heads so
    every tp shard owns one (r times each), the params along `kv_heads` are repeated in place."""
    wide, r = cfg.adapt_to_tp(mesh.shape["tp"])
    if r == 1:
        return cfg, params, 1
    targets = param_shardings(wide, mesh)
    out = jax.tree.map(lambda x: x, params)
    for spec in wide.param_specs():
        if "kv_heads" not in spec.axes:
            continue
        axis = spec.axes.index("kv_heads")
        repeat = jax.jit(lambda x, axis=axis: jnp.repeat(x, r, axis=axis), out_shardings=get_path(targets, spec.name))
        set_path(out, spec.name, repeat(get_path(params, spec.name)))
    return wide, out, r


def place(host_params: dict, cfg: Family, mesh) -> dict:
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


def page_bytes_per_device(cfg: Family, page_size: int, dtype, cache_shardings: dict, group: str | None = None) -> int:
    """Bytes of one page on one device: each cache array's shard of a page (of the arrays of
    one cache group, or of all)."""
    total, n = 0, page_multiple(cache_shardings, cfg)
    for c in cfg.cache_specs():
        if group is not None and c.group != group:
            continue
        # Pages split over n devices: n pages cost each device one page's worth.
        shard = cache_shardings[c.name].shard_shape(c.shape(n, page_size))
        total += int(np.prod(shard)) * np.dtype(dtype).itemsize
    return -(-total // n)


def to_host(x) -> np.ndarray:
    """A program's output as a numpy array. In a group spanning processes an output lives on
    devices of several processes; the small per-row outputs (ids, logprobs) are replicated,
    so this process's own copy is the whole value."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if not x.is_fully_replicated:
        raise ValueError(f"an output of sharding {x.sharding} is split over processes; it cannot be read here")
    return np.asarray(x.addressable_data(0))
