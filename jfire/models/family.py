"""The model-family seam: everything the engine knows about a model, and nothing more.

A family is a frozen config dataclass that subclasses `Family`. The engine, the sharding
rules, the page pool, the KV transfer, conversion and checkpoints read only what is declared
here; none of them reads a family's own fields (head counts, widths, ...):

  params      `param_specs()`: shape, logical axes, source names, init (jfire.models.params)
  cache       `cache_specs()`: each paged cache array with named axes, `pages` included;
              `cache_groups()`: which layers attend what (full, sliding window, chunked),
              each group with its own page pool and its slice of the page table
  layers      `segments()`: runs of identical layers, or of one repeating period of layer
              kinds, each scanned as one `lax.scan` over its stacked params
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

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import numpy as np

from jfire.kernels.cpu_palette import CpuPalette
from jfire.kernels.layer_weights import CodedBlocks
from jfire.kernels.varying import shard_map_mesh

# Cache axes whose size the engine chooses: how many pages, and tokens per page. A pages axis
# that the mesh splits (sequence-sharded pages, for caches with no head axis) is named
# LATENT_PAGES; it is a pages axis all the same.
PAGES, PAGE_SLOTS, LATENT_PAGES = "pages", "page_slots", "latent_pages"
PAGE_AXES = (PAGES, LATENT_PAGES)


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """Layers whose keys and values share one page pool because they attend the same span of
    earlier positions: all of them (full attention), the last `sliding_window` positions
    (Mistral), or the earlier positions of the query's own chunk of `chunk` (Llama 4's local
    layers). A windowed group's pages before the first position any later query sees go back
    to its pool, so a long sequence holds only a window's worth of them."""

    name: str
    sliding_window: int | None = None
    chunk: int | None = None

    @property
    def windowed(self) -> bool:
        return bool(self.sliding_window or self.chunk)

    def first_visible(self, position: int) -> int:
        """The earliest position a query at `position` sees (the attention masks' rule)."""
        first = 0
        if self.sliding_window:
            first = max(first, position - self.sliding_window + 1)
        if self.chunk:
            first = max(first, position // self.chunk * self.chunk)
        return first

    def pages_per_row(self, max_len: int, page_size: int, step_tokens: int) -> int:
        """The most pages one row of this group holds at once, for rows of up to `max_len`
        positions that add up to `step_tokens` per step: the whole row under full attention;
        under a window, the pages from the first position its step's first query sees to the
        step's last (a window's span less one, plus the step's tokens), at most the whole row."""
        whole = -(-max_len // page_size)
        if not self.windowed:
            return whole
        span = min(w for w in (self.sliding_window, self.chunk) if w) - 1 + step_tokens
        return min(whole, (span - 1) // page_size + 2)  # a span not starting on a page boundary takes one more


FULL_ATTENTION = CacheGroup("full")


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """One paged cache array. `sizes` gives each axis its size, None for `pages` and
    `page_slots` (the engine's choice). The `layers` axis comes first so pipeline stages
    split it like the layer weights. `group` names the `CacheGroup` whose pool owns its pages."""

    name: str
    axes: tuple[str, ...]
    sizes: tuple[int | None, ...]
    group: str = FULL_ATTENTION.name

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
    """A run of `count` layers starting at layer `first`, run as one `lax.scan`.

    A uniform segment (no `period`) is `count` identical layers of `kind`, stored as one
    stacked subtree `params[name]` (leading axis: its layers). A periodic segment repeats the
    layer kinds of `period` (e.g. ("dense", "moe")) `count // len(period)` times: one scan step
    runs one whole period, its layers unrolled, so each layer's structure is static inside the
    step; `params[name]` then holds one stacked subtree per position of the period (`stacks()`),
    each with a leading axis of periods.

    A segment that is not `piped` runs outside the pipeline on every stage (its params and
    cache arrays name their layer axis `layers_unpiped`, which pp does not split): a few
    odd layers, such as DeepSeek-V3's leading dense ones, then do not stop pipelining the
    uniform rest. `cache_offset` is where the segment's first layer sits in its cache
    arrays (None: at layer `first`, one cache array spanning every layer)."""

    name: str
    first: int
    count: int
    kind: str  # the family's word for this layer structure, e.g. "dense" or "moe"; "dense+moe" for a period
    piped: bool = True
    cache_offset: int | None = None
    period: tuple[str, ...] = ()  # the layer kinds of one scan step, when more than one layer

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of the layers one scan step runs, in order."""
        return self.period or (self.kind,)

    @property
    def steps(self) -> int:
        """Scan steps: periods (or layers, for a uniform segment). Pipeline stages split these."""
        return self.count // len(self.kinds)

    def stacks(self) -> tuple[LayerStack, ...]:
        """The stacked subtrees of this segment's params, one per position of the period."""
        if not self.period:
            return (LayerStack(self.name, self.kind, self.first, 1, self.count),)
        k = len(self.period)
        return tuple(
            LayerStack(f"{self.name}.{kind}{pos}", kind, self.first + pos, k, self.steps)
            for pos, kind in enumerate(self.period)
        )

    def describe(self) -> str:
        if not self.period:
            return f"{self.count} {self.kind}"
        return f"{self.steps} periods of {len(self.period)} layers ({', '.join(self.period)})"


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """One stacked subtree of a segment's params: `count` layers of `kind`, the model layers
    `first`, `first + step`, ... (step 1 in a uniform segment; the period's length in a
    periodic one). `path` is its dotted path in the params tree."""

    path: str
    kind: str
    first: int
    step: int
    count: int


@dataclasses.dataclass(frozen=True)
class Parallel:
    """The mesh, for blocks that place their own collectives (expert dispatch). Hashable,
    so programs take it as a static argument."""

    mesh: Any

    def shard_map_mesh(self):
        return shard_map_mesh(self.mesh)


def segments_of(kinds: list[str], name: str = "layers") -> tuple[Segment, ...]:
    """Layers of the given kinds as segments. All of one kind: one uniform segment (named
    `layers`). Kinds that repeat with a period (Llama 4 Maverick's dense and MoE layers, a
    Qwen3-MoE sparse step): one periodic segment of whole periods, then any leftover layers as
    runs. Otherwise consecutive runs of equal kinds. Several segments are `layers0`,
    `layers1`, ... in order."""
    kinds = list(kinds)
    period = _period(kinds)
    if len(period) == 1:
        return (Segment(name, 0, len(kinds), kinds[0]),)
    out: list[tuple] = []  # (first, count, kind, period)
    head = 0
    if period:
        head = len(kinds) - len(kinds) % len(period)
        out.append((0, head, "+".join(period), period))
    for i in range(head, len(kinds)):
        if out and not out[-1][3] and out[-1][2] == kinds[i]:
            first, count, kind, _ = out[-1]
            out[-1] = (first, count + 1, kind, ())
        else:
            out.append((i, 1, kinds[i], ()))
    if len(out) == 1:
        first, count, kind, p = out[0]
        return (Segment(name, first, count, kind, period=p),)
    return tuple(Segment(f"{name}{k}", first, count, kind, period=p) for k, (first, count, kind, p) in enumerate(out))


def _period(kinds: list[str]) -> tuple[str, ...]:
    """The shortest period the kinds repeat with, at least twice from layer 0 (a leftover
    shorter than a period may follow); () when there is none."""
    n = len(kinds)
    for p in range(1, n // 2 + 1):
        if all(kinds[i] == kinds[i - p] for i in range(p, n)):
            return tuple(kinds[:p])
    return tuple(kinds[:1]) if n == 1 else ()


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

    def cache_groups(self) -> tuple[CacheGroup, ...]:
        """The groups of layers by what they attend, in page-table order: the program's page
        table [rows, groups x width] holds group g's table in columns [g x width, (g+1) x width).
        Every cache array names one of them; the default, one group of full attention."""
        return (FULL_ATTENTION,)

    def kv_bytes_per_token(self, dtype, group: str | None = None) -> int:
        """Cache bytes one token of one sequence takes, over all layers and cache arrays (or
        over those of one cache group)."""
        specs = [c for c in self.cache_specs() if group is None or c.group == group]
        return sum(c.values_per_token() for c in specs) * np.dtype(dtype).itemsize

    def mesh_problems(self, shape: MeshShape) -> list[str]:
        """Why a mesh of this shape cannot run the model (empty: it can)."""
        problems = []
        if shape.pp > 1:
            segments = [s for s in self.segments() if s.piped]
            if len(segments) != 1:
                problems.append(
                    f"pp={shape.pp} needs one stack of layers, uniform or one repeating period, but this "
                    f"model has {len(segments)} segments ({', '.join(s.describe() for s in segments)})"
                )
            else:
                s = segments[0]
                unit = f"{s.count} layers" if not s.period else s.describe()
                if shape.pp > s.steps:
                    problems.append(f"pp={shape.pp} is more stages than the {unit}")
                elif s.steps % shape.pp:
                    whole = " (a stage holds whole periods)" if s.period else ""
                    problems.append(f"pp={shape.pp} does not divide the {unit} into equal stages{whole}")
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
    """Layers in a stacked subtree (plain or compressed leaves both lead with the layer axis;
    a mesh's coded blocks hold a stage's layers each)."""
    leaf = jax.tree.leaves(stack, is_leaf=lambda x: isinstance(x, CodedBlocks))[0]
    return leaf.depth if isinstance(leaf, CodedBlocks) else leaf.shape[0]


# The captures in progress while a program traces its target's decoder (`capture_hidden`):
# (indices, found) pairs, innermost last.
_captures: list[tuple[tuple[int, ...], dict]] = []


@contextlib.contextmanager
def capture_hidden(indices):
    """While a decoder is traced inside, keeps the residual stream entering each layer of
    `indices` (Hugging Face's `hidden_states` indices: i is layer i's input, the output of
    layer i - 1), for a draft model that reads the target's intermediate states (EAGLE-3).
    Yields a dict that the traced segments fill, index -> [b, t, e]. The scanned layers carry
    one more array per index, set where the layer index matches: no second pass, no per-layer
    output kept. Not inside pipeline stages (their layers run per microbatch)."""
    found: dict[int, Any] = {}
    _captures.append((tuple(indices), found))
    try:
        yield found
    finally:
        _captures.pop()


def _kept(kept: tuple, x, index, indices: tuple[int, ...]) -> tuple:
    """`kept` with x where the layer about to run (`index`) is a captured one."""
    return tuple(jax.numpy.where(index == i, x, k) for i, k in zip(indices, kept))


def _scan_capturing(scan: Callable, layer: Callable, stack, carry, first: int, per_step: int):
    """`scan(layer, stack, carry)` keeping the captured layers' inputs (see capture_hidden):
    x is the first element of every family's carry; a scan step runs `per_step` layers."""
    indices, found = _captures[-1]
    zeros = tuple(jax.numpy.zeros_like(carry[0]) for _ in indices)
    (carry, kept) = scan(layer, stack, (carry, zeros))
    depth = stack_depth(stack) * per_step
    for i, k in zip(indices, kept):
        if first <= i < first + depth:
            found[i] = k
    return carry


def scan_layers(layer: Callable, stack, carry, dtype, *, in_place: bool = False, first: int | None = None):
    """`lax.scan` of `layer(carry, p, j) -> (carry, None)` over a segment's stacked weights,
    j the layer's index in the stack. The cache rides in the carry so each layer updates it in
    place (a scanned-over output would be a second full copy of the pool). Weights kept
    compressed in device memory are decoded just before their layer runs.

    `in_place`: the layer reads its weights through `jfire.models.blocks.layer_matmul`, which
    can take them from the whole stack; where the program enables that
    (`jfire.kernels.cpu_matmul.in_place`), `p` is a `StackedLayer` view instead of slices."""
    from jfire.kernels import cpu_matmul, cpu_palette
    from jfire.kernels.layer_weights import has_compressed, has_fused, layer_slice

    if _captures and first is not None:  # `first`: the model layer of the stack's first entry

        def capturing(c, p, j):
            inner, kept = c
            kept = _kept(kept, inner[0], first + j, _captures[-1][0])
            inner, out = layer(inner, p, j)
            return (inner, kept), out

        scan = functools.partial(scan_layers, dtype=dtype, in_place=in_place)
        return _scan_capturing(scan, capturing, stack, carry, first, 1)
    ids = jax.numpy.arange(stack_depth(stack), dtype=jax.numpy.int32)
    if has_fused(stack):  # weights multiplied coded: the layer reads each leaf as it needs it
        carry, _ = jax.lax.scan(lambda c, j: layer(c, CodedLayer(stack, j, dtype), j), carry, ids)
    elif has_compressed(stack):
        carry, _ = jax.lax.scan(lambda c, j: layer(c, layer_slice(stack, j, dtype=dtype), j), carry, ids)
    elif (in_place and cpu_matmul.in_place_enabled()) or cpu_palette.has_coded(stack):
        # (A coded stack is never scanned over: its arrays are not layer-major values.)
        carry, _ = jax.lax.scan(lambda c, j: layer(c, StackedLayer(stack, j), j), carry, ids)
    else:
        carry, _ = jax.lax.scan(lambda c, xs: layer(c, *xs), carry, (stack, ids))
    return carry


def scan_segment(segment: Segment, layer: Callable, stack, carry, dtype, *, in_place: bool = False):
    """Every layer of `segment` through `layer(carry, p, j, kind) -> carry`, `j` the layer's
    index in the segment (traced), `kind` its kind (static), `p` its weights. One `lax.scan`
    step per layer of a uniform segment, or per period of a periodic one, whose layers are then
    unrolled inside the step (each reading its position's stack at the period's index)."""
    if not segment.period:
        return scan_layers(
            lambda c, p, j: (layer(c, p, j, segment.kind), None),
            stack,
            carry,
            dtype,
            in_place=in_place,
            first=segment.first,
        )
    k = len(segment.period)
    keys = [s.path.rsplit(".", 1)[1] for s in segment.stacks()]
    capturing = bool(_captures)

    def period(c, p, j):
        for pos, (key, kind) in enumerate(zip(keys, segment.period)):
            if capturing:  # the layers of a period are unrolled: each checked by its own index
                inner, kept = c
                kept = _kept(kept, inner[0], segment.first + j * k + pos, _captures[-1][0])
                c = (layer(inner, p[key], j * k + pos, kind), kept)
            else:
                c = layer(c, p[key], j * k + pos, kind)
        return c, None

    if capturing:
        scan = functools.partial(scan_layers, dtype=dtype, in_place=in_place)
        return _scan_capturing(scan, period, stack, carry, segment.first, k)
    return scan_layers(period, stack, carry, dtype, in_place=in_place)


class StackedLayer(Mapping):
    """Layer `index` of a stacked weight tree, read lazily: `p[name]` slices that layer out
    (XLA:CPU copies it), while `layer_matmul` can multiply by it straight from the stack."""

    def __init__(self, stack: Mapping, index):
        self.stack, self.index = stack, index

    def __getitem__(self, name):
        value = self.stack[name]
        if isinstance(value, Mapping):  # a periodic segment's stack of one position
            return StackedLayer(value, self.index)
        if isinstance(value, CpuPalette):  # decoded for a product the coded kernel does not take
            return value.layer(self.index)
        return jax.lax.dynamic_index_in_dim(value, self.index, keepdims=False)

    def __iter__(self):
        return iter(self.stack)

    def __len__(self):
        return len(self.stack)


class CodedLayer(StackedLayer):
    """Layer `index` of a stack kept coded (`--keep-compressed`) with weights the layers
    multiply by coded (`FusedPalette`): `layer_matmul` reads those from the stack; every other
    read decodes its leaf's layer then, in `dtype`."""

    def __init__(self, stack: Mapping, index, dtype):
        super().__init__(stack, index)
        self.dtype = dtype

    def __getitem__(self, name):
        from jfire.kernels.layer_weights import leaf_layer

        value = self.stack[name]
        if isinstance(value, Mapping):
            return CodedLayer(value, self.index, self.dtype)
        return leaf_layer(value, self.index, self.dtype)


# -- whole-model helpers for tests and tools ------------------------------------------------------


def group_table(cfg: Family, page_table, group: str):
    """Group `group`'s columns of a program's page table [rows, groups x width]."""
    names = [g.name for g in cfg.cache_groups()]
    if len(names) == 1:
        return page_table
    width = page_table.shape[1] // len(names)
    g = names.index(group)
    return page_table[:, g * width : (g + 1) * width]


def init_cache(cfg: Family, batch: int, max_len: int, dtype, page_size: int = 16) -> dict:
    """A fresh cache for `batch` rows of up to `max_len` positions, each row owning its own
    consecutive pages in every cache group: the contiguous layout, expressed as pages and a
    page table."""
    import jax.numpy as jnp

    per_row = -(-max_len // page_size)
    cache = {c.name: jnp.zeros(c.shape(batch * per_row, page_size), dtype) for c in cfg.cache_specs()}
    one = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
    cache["page_table"] = jnp.tile(one, (1, len(cfg.cache_groups())))
    return cache


def forward(params: dict, cfg: Family, tokens, positions, cache: dict):
    """Logits [b, t, v] (float32) for every token, and the updated cache (from `init_cache`)."""
    table = cache["page_table"]
    pages = {k: v for k, v in cache.items() if k != "page_table"}
    hidden, pages = cfg.decoder(params, tokens, positions, pages, table)
    return cfg.logits(params, hidden), {**pages, "page_table": table}
