"""The model-family seam: everything the engine knows about a model, and nothing more.

A family is a frozen config dataclass that subclasses `Family`. The engine, the sharding
rules, the page pool, the KV transfer, conversion and checkpoints read only what is declared
here; none of them reads a family's own fields (head counts, widths, ...):

  params      `param_specs()`: shape, logical axes, source names, init (jfire.models.params)
  cache       `cache_specs()`: each paged cache array with named axes, `pages` included
  layers      `segments()`: runs of identical layers, each one scanned stack in the params
  meshes      `mesh_problems(shape)`: what a mesh must divide; `adapt_to_tp(tp)`: how the
              family reshapes itself for a tensor-parallel width (e.g. repeating KV heads)
  forward     `decoder(...)`, `run_segment(...)`, `logits(...)`: prefill chunks and decode
              steps are the same call with t tokens per row. The pre-norm families share
              one `decoder` and `logits` (`jfire.models.blocks.PreNormFamily`) and each
              supplies only its scanned layer loop, `run_segment`

The common fields every family carries (vocabulary, context, special tokens) are part of the
interface too: `vocab_size`, `max_position_embeddings`, `bos_token_id`, `eos_token_ids`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import numpy as np

# Cache axes whose size the engine chooses: how many pages, and tokens per page. A pages axis
# that the mesh splits (sequence-sharded pages, for caches with no head axis) is named
# LATENT_PAGES; it is a pages axis all the same.
PAGES, PAGE_SLOTS, LATENT_PAGES = "pages", "page_slots", "latent_pages"
PAGE_AXES = (PAGES, LATENT_PAGES)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """One paged cache array. `sizes` gives each axis its size, None for `pages` and
    `page_slots` (the engine's choice). The `layers` axis comes first so pipeline stages
    split it like the layer weights."""

    name: str
    axes: tuple[str, ...]
    sizes: tuple[int | None, ...]

    @property
    def pages_axis(self) -> int:
        return next(i for i, a in enumerate(self.axes) if a in PAGE_AXES)

    def shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        fill = {PAGES: num_pages, LATENT_PAGES: num_pages, PAGE_SLOTS: page_size}
        return tuple(fill.get(a, s) for a, s in zip(self.axes, self.sizes))

    def values_per_token(self) -> int:
        return math.prod(s for a, s in zip(self.axes, self.sizes) if a not in (*PAGE_AXES, PAGE_SLOTS))

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        """One page of this array (the pages axis dropped): the KV wire format's unit."""
        full, i = self.shape(1, page_size), self.pages_axis
        return full[:i] + full[i + 1 :]

    def page_axes(self) -> tuple[str, ...]:
        return tuple(a for i, a in enumerate(self.axes) if i != self.pages_axis)


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of `count` identical layers starting at layer `first`, stored as one stacked
    subtree `params[name]` (leading axis: its layers) and run as one `lax.scan`.

    A segment that is not `piped` runs outside the pipeline on every stage (its params and
    cache arrays name their layer axis `layers_unpiped`, which pp does not split): a few
    odd layers, such as DeepSeek-V3's leading dense ones, then do not stop pipelining the
    uniform rest. `cache_offset` is where the segment's first layer sits in its cache
    arrays (None: at layer `first`, one cache array spanning every layer)."""

    name: str
    first: int
    count: int
    kind: str  # the family's word for this layer structure, e.g. "dense" or "moe"
    piped: bool = True
    cache_offset: int | None = None


@dataclasses.dataclass(frozen=True)
class Parallel:
    """The mesh, for blocks that place their own collectives (expert dispatch). Hashable,
    so programs take it as a static argument."""

    mesh: Any

    def shard_map_mesh(self):
        return shard_map_mesh(self.mesh)


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


def segments_of(kinds: list[str], name: str = "layers") -> tuple[Segment, ...]:
    """Consecutive runs of equal layer kinds as segments. One run keeps the plain name
    (`layers`); several are `layers0`, `layers1`, ... in order."""
    runs: list[list] = []
    for i, kind in enumerate(kinds):
        if runs and runs[-1][0] == kind:
            runs[-1][2] += 1
        else:
            runs.append([kind, i, 1])
    if len(runs) == 1:
        return (Segment(name, 0, runs[0][2], runs[0][0]),)
    return tuple(Segment(f"{name}{k}", first, count, kind) for k, (kind, first, count) in enumerate(runs))


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The axis sizes a family is asked about (jfire.mesh.MeshSpec has them)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1


class Family:
    """Base of every family's config dataclass: the interface, plus what families share."""

    family: ClassVar[str]  # the registry key, written into checkpoints

    # -- construction (each family implements from_hf/from_gguf; to/from_dict are shared) --------

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in fields}
        for name, value in list(d.items()):
            d[name] = _revive(fields[name].type, value, cls)
        return cls(**d)

    # -- declarations ----------------------------------------------------------------------------

    def param_specs(self) -> tuple:
        raise NotImplementedError

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        raise NotImplementedError

    def segments(self) -> tuple[Segment, ...]:
        raise NotImplementedError

    def kv_bytes_per_token(self, dtype) -> int:
        """Cache bytes one token of one sequence takes, over all layers and cache arrays."""
        return sum(c.values_per_token() for c in self.cache_specs()) * np.dtype(dtype).itemsize

    def mesh_problems(self, shape: MeshShape) -> list[str]:
        """Why a mesh of this shape cannot run the model (empty: it can)."""
        problems = []
        if shape.pp > 1:
            segments = [s for s in self.segments() if s.piped]
            if len(segments) != 1:
                problems.append(
                    f"pp={shape.pp} needs one uniform stack of layers, but this model has "
                    f"{len(segments)} segments ({', '.join(f'{s.count} {s.kind}' for s in segments)})"
                )
            elif shape.pp > segments[0].count:
                problems.append(f"pp={shape.pp} is more stages than the {segments[0].count} layers")
            elif segments[0].count % shape.pp:
                problems.append(f"pp={shape.pp} does not divide the {segments[0].count} layers into equal stages")
        return problems

    def skipped_source_prefixes(self) -> tuple[str, ...]:
        """Source tensor name prefixes the family leaves unread on purpose (e.g. a vision tower)."""
        return ()

    def adapt_to_tp(self, tp: int):
        """(config for a tp-way mesh, how many times each cache head is repeated). Families
        whose cache heads cannot split over tp repeat them; the default changes nothing."""
        return self, 1

    # -- the forward pass ------------------------------------------------------------------------

    def decoder(
        self,
        params: dict,
        tokens,
        positions,
        pages: dict,
        page_table,
        *,
        attention_impl=None,
        layer_stack=None,
        parallel=None,
    ):
        """Runs tokens [b, t] at positions [b, t] (-1 = padding) against the paged cache;
        returns (hidden [b, t, e], pages). `layer_stack(run, stack, x, positions, pages,
        page_table)` replaces running a segment's stack (the pipeline plugs in here);
        `parallel` (a `Parallel` or None) names the mesh for blocks that
        need explicit collectives, such as expert dispatch."""
        raise NotImplementedError

    def logits(self, params: dict, hidden):
        raise NotImplementedError


def run_segments(
    cfg: Family,
    params: dict,
    x,
    positions,
    pages: dict,
    page_table,
    *,
    run: Callable,
    attention_impl=None,
    layer_stack=None,
    parallel=None,
):
    """Runs every segment of `cfg` in order. `run(segment, stack, x, positions, pages,
    page_table, layer_offset, cache_offset, attention_impl=, parallel=)` is the family's
    scanned layer loop: `layer_offset` is the model layer of the stack's first entry (for
    per-layer data), `cache_offset` where that layer sits in the given pages. A pipeline
    stage passes its own slice of the stack and the cache, and its own offsets."""
    piped_arrays = {c.name for c in cfg.cache_specs() if c.axes[0] == "layers"}
    for segment in cfg.segments():
        bound = _SegmentRun(functools.partial(run, cfg), segment, attention_impl, parallel)
        if layer_stack is not None and segment.piped:
            # The pipeline splits the layer axis of what it is given: only the piped arrays.
            staged, rest = ({k: v for k, v in pages.items() if (k in piped_arrays) == keep} for keep in (True, False))
            x, staged = layer_stack(bound, params[segment.name], x, positions, staged, page_table)
            pages = {**rest, **staged}
        else:
            offset = segment.first if segment.cache_offset is None else segment.cache_offset
            x, pages = bound(params[segment.name], x, positions, pages, page_table, segment.first, offset)
    return x, pages


@dataclasses.dataclass(frozen=True)
class _SegmentRun:
    run: Callable
    segment: Segment
    attention_impl: Callable | None
    parallel: Any

    def __call__(self, stack, x, positions, pages, page_table, layer_offset, cache_offset):
        return self.run(
            self.segment,
            stack,
            x,
            positions,
            pages,
            page_table,
            layer_offset,
            cache_offset,
            attention_impl=self.attention_impl,
            parallel=self.parallel,
        )


def _revive(annotation, value, cls):
    """JSON back into the config's field types: tuples and nested dataclasses."""
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    if isinstance(value, dict):
        hint = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        module = __import__(cls.__module__, fromlist=["*"])
        for name in hint.replace("|", " ").split():
            klass = getattr(module, name, None)
            if dataclasses.is_dataclass(klass):
                return klass(**value)
    return value


def stack_depth(stack) -> int:
    """Layers in a stacked subtree (plain or compressed leaves both lead with the layer axis)."""
    return jax.tree.leaves(stack)[0].shape[0]


def scan_layers(layer: Callable, stack, carry, dtype, *, in_place: bool = False):
    """`lax.scan` of `layer(carry, p, j) -> (carry, None)` over a segment's stacked weights,
    j the layer's index in the stack. The cache rides in the carry so each layer updates it in
    place (a scanned-over output would be a second full copy of the pool). Weights kept
    compressed in device memory are decoded just before their layer runs.

    `in_place`: the layer reads its weights through `jfire.models.blocks.layer_matmul`, which
    can take them from the whole stack; where the program enables that
    (`jfire.kernels.cpu_matmul.in_place`), `p` is a `StackedLayer` view instead of slices."""
    from jfire.kernels import cpu_matmul
    from jfire.kernels.layer_weights import has_compressed, layer_slice

    ids = jax.numpy.arange(stack_depth(stack), dtype=jax.numpy.int32)
    if has_compressed(stack):
        carry, _ = jax.lax.scan(lambda c, j: layer(c, layer_slice(stack, j, dtype=dtype), j), carry, ids)
    elif in_place and cpu_matmul.in_place_enabled():
        carry, _ = jax.lax.scan(lambda c, j: layer(c, StackedLayer(stack, j), j), carry, ids)
    else:
        carry, _ = jax.lax.scan(lambda c, xs: layer(c, *xs), carry, (stack, ids))
    return carry


class StackedLayer(Mapping):
    """Layer `index` of a stacked weight tree, read lazily: `p[name]` slices that layer out
    (XLA:CPU copies it), while `layer_matmul` can multiply by it straight from the stack."""

    def __init__(self, stack: Mapping, index):
        self.stack, self.index = stack, index

    def __getitem__(self, name):
        return jax.lax.dynamic_index_in_dim(self.stack[name], self.index, keepdims=False)

    def __iter__(self):
        return iter(self.stack)

    def __len__(self):
        return len(self.stack)


# -- whole-model helpers for tests and tools ------------------------------------------------------


def init_cache(cfg: Family, batch: int, max_len: int, dtype, page_size: int = 16) -> dict:
    """A fresh cache for `batch` rows of up to `max_len` positions, each row owning its own
    consecutive pages: the contiguous layout, expressed as pages and a page table."""
    import jax.numpy as jnp

    per_row = -(-max_len // page_size)
    cache = {c.name: jnp.zeros(c.shape(batch * per_row, page_size), dtype) for c in cfg.cache_specs()}
    cache["page_table"] = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
    return cache


def forward(params: dict, cfg: Family, tokens, positions, cache: dict):
    """Logits [b, t, v] (float32) for every token, and the updated cache (from `init_cache`)."""
    table = cache["page_table"]
    pages = {k: v for k, v in cache.items() if k != "page_table"}
    hidden, pages = cfg.decoder(params, tokens, positions, pages, table)
    return cfg.logits(params, hidden), {**pages, "page_table": table}
