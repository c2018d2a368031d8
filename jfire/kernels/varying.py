"""Varying mesh axes inside a shard_map that checks them (check_vma), and the mesh a nested
shard_map names.

There a value's type records the manual mesh axes it varies over, and a loop's carry or a
kernel's operands must agree: a constant initial carry is invariant while the body's result,
computed from a per-shard cache, varies. These helpers mark values as varying where needed;
outside a shard_map they change nothing.
"""

from __future__ import annotations

import jax


def varying(x) -> frozenset:
    """The manual mesh axes x varies over inside a shard_map (empty outside one)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_as(values, *refs):
    """The pytree `values`, each leaf marked as varying over every axis any of refs varies over."""
    union = frozenset().union(*map(varying, refs))

    def one(x):
        missing = union - varying(x)
        return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    return jax.tree.map(one, values)


def vary_alike(*operands):
    """The operands, each marked as varying over every manual mesh axis any of them varies
    over: inside a shard_map that checks varying axes (the expert-parallel dispatch) a
    kernel takes operands that agree, and its output is per shard like them."""
    return vary_as(list(operands), *operands)


def out_struct(shape, dtype, like):
    """A pallas_call's out_shape; inside a shard_map that checks varying axes (check_vma) it
    must state them: those of `like`, the buffer the output aliases."""
    aval = jax.typeof(like)
    if getattr(aval, "manual_axis_type", None) is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
    if getattr(aval, "vma", None) is not None:  # the name in older JAX releases
        return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)
    return jax.ShapeDtypeStruct(shape, dtype)


def shard_map_mesh(mesh):
    """The mesh a block's own `shard_map` names: `mesh`, or inside another shard_map (the
    pipeline's, manual over pp) the context's abstract mesh, which jax 0.10.2 requires there
    ("The context mesh ... should match the mesh passed to shard_map", since the context
    marks the outer axes Manual); same axes and sizes."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty or not context.manual_axes:
        return mesh
    if dict(context.shape) != dict(mesh.shape):
        raise ValueError(f"mesh {dict(mesh.shape)} is not the enclosing shard_map's mesh {dict(context.shape)}")
    return context
