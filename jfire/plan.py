"""`jfire plan`: what a model costs on a mesh, per device, before a single weight is read.

From a config alone (a HF `config.json`, a jfire checkpoint's manifest or a GGUF header) the
plan builds the model's parameters and paged cache as abstract arrays on the mesh, with the
shardings the engine gives them (`jfire.sharding`, after the family's `adapt_to_tp`: KV heads
repeated for a wide tp cost memory, and are counted), and adds up, for each device:

  weights     each parameter's shard on that device (`devices_indices_map`), exact, in the
              param's own dtype (`spec_dtype`: packed int4 words int32, a router bias float32)
  workspace   the temporaries of the largest compiled programs (the widest decode bucket and
              the fullest prefill bucket), from XLA's `memory_analysis()` of programs lowered
              from ShapeDtypeStructs on fake CPU devices (nothing is allocated), or, with
              `compile=False`, `estimate_workspace`'s stated formula
  reserve     RESERVE_BYTES, a stated constant: CUDA context, library workspaces, allocator slack
  free        device memory - weights - workspace - reserve: the room for the KV cache

and sizes the KV page pools in what is free on the device with the least room exactly as the
engine does (`kv_pools`: `jfire.runner.pool_size` itself, over each cache group's bytes of a page
on a device: a pages axis split over a stage's devices, MLA's latent, counted as 1/n of a page;
an array kept on every pipeline stage counted on each). A model whose layers attend different
spans has a pool per kind of layer (`Family.cache_groups()`): each windowed group (a sliding
window, Llama 4's chunks) gets every row's window, `--max-batch` rows of the most pages a row
holds of it at once, and the full-attention group the rest. `kv_capacity_tokens` is then the
tokens of context the pools hold with every row's window so reserved: the full-attention
group's pages x the page size (for a model whose groups are all windowed, their pages x the page
size); one sequence holds at most `max_tokens_per_sequence` of them (docs/plan.md, "The KV
pools").

Workspace on XLA:CPU. For bfloat16 models XLA:CPU upcasts every dot to float32 and hoists a
float32 copy of each whole stacked weight out of the layer loop (for Llama 4 Scout on tp=2,
temporaries of twice the device's bf16 weights), which a GPU, with native bf16 dots, has no need
to do. So the programs are measured with float32 weights and cache instead (WORKSPACE_DTYPE):
there XLA:CPU materialises one layer's weight slices per scan step plus the activations, both at
4 bytes a value where the GPU's bf16 program holds 2. The workspace is meant as an upper bound
(for Scout on tp=2 about twice the bf16 layer slice the GPU would copy); it has not been checked
on a GPU.
Packed int4 experts stay int32 words there, and run through the GPU kernel's tiling (INT4_IMPL),
not XLA:CPU's path that unpacks a whole layer: for Kimi K2.5 on pp=2 x tp=4 the workspace is
then mostly one MoE layer's packed experts and their (float32 here, bf16 on a GPU) scales,
sliced out of the stacked layers per scan step. FP8 experts enter as their bytes (FP8_AS_BYTES)
and are multiplied by expert in lax loops, one layer's local experts dequantized at a time as on
a GPU: for DeepSeek-V3 on pp=2 x tp=8 that layer, in float32 (twice its bf16 size on a GPU), is
most of the workspace.

Throughput and cost on paper (jfire/throughput.py, docs/plan.md): where the mesh file's [device]
table gives the device's spec-sheet bandwidth and bf16 FLOP/s, the plan adds bounds on decode
tokens/s at a few batch sizes, prefill tokens/s and TTFT at a few prompt lengths, and the cost
per million output tokens, from the bytes each device reads and the FLOPs it does per step
(`step_passes` counts the weights, as held above).

`jfire serve` and `jfire launch` size their page pools with `plan` itself (`--kv-cache-gb auto`,
jfire/device_memory.py: the workspace estimated, the device's memory its allocator's limit; the
engine is given the bytes of the plan's pools, from which it sizes the same pools) and refuse to
start with `format_refusal`'s figures where one full context does not fit.

The figures these plans come to are printed by `jfire plan`; the README shows the plans of the
shipped meshes, kept equal to the code by its tests, and they are copied nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jfire import mesh as meshes
from jfire import sharding, throughput
from jfire.checkpoint.load import DTYPES
from jfire.errors import JfireError
from jfire.kernels import int4_experts
from jfire.kernels.paged_attention import block_pages
from jfire.models.family import Family, Parallel
from jfire.models.params import ParamSpec, get_path, set_path, spec_dtype

GIB = 1 << 30
# Per device, beyond what XLA allocates: the CUDA context (typically ~0.5 GiB), cuBLAS/cuDNN
# workspaces and the allocator's fragmentation. A stated constant, not a measurement.
RESERVE_BYTES = 1 * GIB
WORKSPACE_DTYPE = jnp.float32  # see the module docstring: XLA:CPU's bf16 programs are not representative
# How the measured programs run packed int4 experts: the GPU kernel's tiling in plain lax loops
# ("tiled": one [64, in] tile of codes unpacked at a time, as the Pallas kernel does), not the
# CPU's "xla" path, which unpacks a whole layer's local experts into float32 (eight times their
# packed bytes, which a GPU never holds). The interpreted Pallas kernel itself would be the
# closer stand-in, but JAX 0.10.2's interpreter fails inside the expert-parallel shard_map.
INT4_IMPL = "tiled"
# FP8 expert weights enter the measured programs as their bytes (uint8), turned back into FP8
# inside the layer step (`fp8_experts.dequantize`): handed float8 arrays, XLA:CPU, which has no
# FP8 arithmetic, widens every whole stacked FP8 weight to bf16 before the layer loop (twice the
# bytes of every MoE layer's local experts at once), which a GPU with native FP8 types has no need
# to do. The bytes and the per-step work are the same either way.
FP8_AS_BYTES = jnp.uint8
# The estimate's allowance for per-token activations (residual stream, norms, q/k/v, MLP
# intermediates, router), in values of the embed width per token.
ACTIVATION_VALUES_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class Limits:
    """The engine limits that size the compiled programs (None: the engine's own default)."""

    max_batch: int | None = None
    prefill_budget: int | None = None
    max_context: int | None = None


# -- inputs -----------------------------------------------------------------------------------------


def read_model_config(model: str | Path) -> Family:
    """The family config of a HF directory (config.json alone is enough), a jfire checkpoint
    or a .gguf file, without touching any weights."""
    from jfire.checkpoint import store
    from jfire.models.registry import config_from_hf

    path = Path(model).expanduser()
    if not path.exists():
        raise JfireError(
            f"model path {str(path)!r} does not exist (give a directory with config.json, "
            "a jfire checkpoint or a .gguf file)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise JfireError(
                f"{path} is a file but not a .gguf; give a model directory with config.json, "
                "a jfire checkpoint directory or a .gguf file"
            )
        from jfire.checkpoint.sources import GGUFSource

        return GGUFSource(path).config
    if store.is_checkpoint(path):
        return store.read_config(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise JfireError(
            f"{path} has no config.json (and is not a jfire checkpoint); jfire plan needs the "
            "model's config.json, and nothing else"
        )
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise JfireError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise JfireError(f"{config_file} must hold a JSON object, not a {type(hf).__name__}")
    try:
        return config_from_hf(hf)
    except KeyError as e:
        raise JfireError(f"{config_file} lacks the required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise JfireError(f"{config_file} has a value of the wrong type ({e})") from None


def device_memory(spec: meshes.MeshSpec, override_gib: float | None) -> tuple[str | None, float, str]:
    """(device kind, GiB per device, where the number came from): `--device-memory-gib`
    wins over the mesh file's [device] table; neither is a clear refusal."""
    if override_gib is not None:
        if not override_gib > 0:
            raise JfireError(f"--device-memory-gib must be > 0, got {override_gib}")
        return spec.device_kind, float(override_gib), "--device-memory-gib"
    if spec.device_memory_gib is None:
        raise JfireError(
            f"mesh {spec.name!r} does not say how much memory its devices have: add a [device] "
            'table to its mesh file (e.g. kind = "H200" and memory_gib = 140.0, the usable memory '
            "per device as the driver reports it), or pass --device-memory-gib N"
        )
    return spec.device_kind, float(spec.device_memory_gib), "mesh file"


# -- bytes per device -------------------------------------------------------------------------------


def shard_bytes(sharding_, shape: tuple[int, ...], itemsize: int) -> dict:
    """Bytes of `shape` each device holds under `sharding_`, from its index map."""
    out = {}
    for device, index in sharding_.devices_indices_map(tuple(shape)).items():
        count = 1
        for slc, dim in zip(index, shape):
            count *= len(range(*slc.indices(dim)))
        out[device] = count * itemsize
    return out


def _add(total: dict, part: dict) -> None:
    for device, n in part.items():
        total[device] = total.get(device, 0) + n


def _shardings(cfg: Family, mesh, device):
    """(param shardings tree, cache shardings dict) as the engine places them; one device
    when mesh is None (the engine then uses no mesh at all)."""
    if mesh is not None:
        return sharding.param_shardings(cfg, mesh), sharding.cache_shardings(cfg, mesh)
    single = SingleDeviceSharding(device)
    params: dict = {}
    for spec in cfg.param_specs():
        set_path(params, spec.name, single)
    return params, {c.name: single for c in cfg.cache_specs()}


def weight_bytes(cfg: Family, param_shardings: dict, dtype) -> dict:
    """Each device's parameter bytes, every param in its own dtype (`spec_dtype`: packed int4
    words are int32, a router bias float32, the rest the model dtype)."""
    total: dict = {}
    for spec in cfg.param_specs():
        itemsize = spec_dtype(spec, dtype).itemsize
        _add(total, shard_bytes(get_path(param_shardings, spec.name), spec.shape, itemsize))
    return total


def weights_held(spec: ParamSpec) -> int:
    """How many model weights a param holds: a packed int4 param eight per int32 word, an FP8
    one one per byte; the quantization scales of quantized weights none (they are bytes, not
    parameters)."""
    if spec.init == "int4":
        return math.prod(spec.shape) * spec_dtype(spec, None).itemsize * 2  # two 4-bit weights a byte
    if spec.init in ("int4_scale", "fp8_scale"):
        return 0
    return math.prod(spec.shape)


def parameter_counts(cfg: Family, dtype) -> dict:
    """The model's parameters (quantized weights counted one each, scales not at all) and its
    bytes, every param in its own dtype; the int4 and FP8 weights and their scales also on their own."""
    out = {
        "parameters": 0,
        "parameter_bytes": 0,
        "int4_parameters": 0,
        "int4_bytes": 0,
        "fp8_parameters": 0,
        "fp8_bytes": 0,
        "scale_bytes": 0,
    }
    for spec in cfg.param_specs():
        size = math.prod(spec.shape) * spec_dtype(spec, dtype).itemsize
        out["parameters"] += weights_held(spec)
        out["parameter_bytes"] += size
        if spec.init in ("int4", "fp8"):
            out[f"{spec.init}_parameters"] += weights_held(spec)
            out[f"{spec.init}_bytes"] += size
        elif spec.init in ("int4_scale", "fp8_scale"):
            out["scale_bytes"] += size
    return out


def _pages_split(cfg: Family, cache_shardings: dict) -> int:
    """How many ways the pages axis is split (1 without a mesh, or with head-split caches)."""
    first = next(iter(cache_shardings.values()), None)
    if not isinstance(first, jax.sharding.NamedSharding):
        return 1
    return sharding.page_multiple(cache_shardings, cfg)


def kv_bytes_per_token(cfg: Family, cache_shardings: dict, dtype, group: str | None = None) -> dict:
    """Cache bytes one token of one sequence takes on each device, in every cache group (or in
    one). A pages axis split over n devices (MLA's `latent_pages`) cannot split one page, so
    this measures n pages of one slot and divides back by n, as `sharding.page_bytes_per_device`
    does (rounded up); an array not split over pp (a dense first layer's latent) counts on
    every stage."""
    n = _pages_split(cfg, cache_shardings)
    total: dict = {}
    for c in cfg.cache_specs():
        if group is None or c.group == group:
            _add(total, shard_bytes(cache_shardings[c.name], c.shape(n, 1), np.dtype(dtype).itemsize))
    return {device: -(-b // n) for device, b in total.items()}


def layer_bytes(cfg: Family, param_shardings: dict, dtype) -> int:
    """One layer's weights on one device as its step holds them, each param in its own dtype
    (`dtype` for the rest; FP8 experts in `dtype` too, as the step dequantizes them): the
    largest segment's per-layer shards (a device holds whole layers of its pipeline stage,
    each split over tp/ep). A periodic segment's step runs a whole period, so its figure is
    the period's layers together (every position's stack sits under the segment's name)."""
    per_segment: dict = {}
    for spec in cfg.param_specs():
        if spec.per_layer:
            shard = get_path(param_shardings, spec.name).shard_shape(spec.shape)
            segment = spec.name.split(".")[0]
            held = dtype if spec.init == "fp8" else spec_dtype(spec, dtype)
            size = math.prod(shard[1:]) * np.dtype(held).itemsize
            per_segment[segment] = per_segment.get(segment, 0) + size
    return max(per_segment.values(), default=0)


def kv_values_per_layer(cfg: Family, cache_shardings: dict) -> int:
    """Cache values one token takes in one layer, as a device reading a whole page table
    sees them: its share of the other axes (K/V heads split over tp), the pages axis whole,
    since the reference attention gathers every row's full page table on every device, also
    where the pages are split (MLA, which then masks the pages it does not hold). Summed over
    a cache group's arrays (K and V; for MLA the dense and MoE latents, of which a layer reads
    one: an upper bound), the most of any group (a layer reads its own group's)."""
    n = _pages_split(cfg, cache_shardings)
    total: dict = {}
    for c in cfg.cache_specs():
        shard = cache_shardings[c.name].shard_shape(c.shape(n, 1))
        skip = {c.pages_axis} | ({0} if c.axes[0] in ("layers", "layers_unpiped") else set())
        total[c.group] = total.get(c.group, 0) + math.prod(d for i, d in enumerate(shard) if i not in skip)
    return max(total.values(), default=0)


def step_passes(cfg: Family, param_shardings: dict, dtype, pp: int) -> tuple[throughput.Pass, throughput.Pass]:
    """What one device reads and multiplies of its weights in a step (jfire/throughput.py): the
    part outside the pipeline, once a step (everything when pp == 1), and one stage's part,
    once a tick. Each param's shard in its own dtype, as `weight_bytes` counts it; the routed
    experts (an `experts` axis, their scales too) apart, since a step reads only those its
    tokens touch; the embedding table looked up (a row a token), not read, unless it is also
    the LM head; the LM head multiplied by one token a row (the sampled one)."""
    piped = {s.name for s in cfg.segments() if s.piped and pp > 1}
    once, tick = throughput.Pass(), throughput.Pass(share=pp)
    names = {spec.name for spec in cfg.param_specs()}
    fields = cfg.to_dict()
    experts, per_token = fields.get("num_experts", 0), fields.get("experts_per_token", 0)
    for spec in cfg.param_specs():
        if spec.name == "embed" and "lm_head" in names:
            continue
        part = tick if spec.name.split(".")[0] in piped else once
        held = math.prod(get_path(param_shardings, spec.name).shard_shape(spec.shape))
        read = held * spec_dtype(spec, dtype).itemsize
        flops = 2 * weights_held(spec) * held / math.prod(spec.shape)
        if "experts" in spec.axes:
            part.expert_bytes += read
            part.token_flops += flops * per_token / experts
        else:
            part.weight_bytes += read
            if spec.name in ("lm_head", "embed"):
                part.row_flops += flops
            else:
                part.token_flops += flops
    for segment in cfg.segments():
        part = tick if segment.name in piped else once
        part.layers += tuple(range(segment.first, segment.first + segment.count))
    return once, tick


# -- the programs and their workspace ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
    kind: str  # "decode" or "prefill"
    rows: int
    tokens: int  # per row
    width: int  # pages per row


def largest_programs(buckets) -> list[Program]:
    """The widest decode bucket and the prefill bucket with the most tokens (then rows): the
    ones with the most temporaries."""
    width = buckets.pages_per_row
    rows, tokens = max(buckets.prefill_shapes, key=lambda s: (s[0] * s[1], s[0]))
    return [Program("decode", max(buckets.decode_batches), 1, width), Program("prefill", rows, tokens, width)]


def measure_workspace(
    cfg: Family,
    param_shardings: dict,
    cache_shardings: dict,
    programs: list[Program],
    *,
    mesh,
    spec: meshes.MeshSpec,
    page_size: int,
) -> list[dict]:
    """XLA's memory analysis of each program, compiled on the CPU devices from abstract
    params and cache in WORKSPACE_DTYPE: temporaries plus outputs that do not alias the
    donated cache."""
    from jfire.pipeline import Pipeline
    from jfire.programs import Buckets, CompiledPrograms
    from jfire.sampling import PenaltyState

    params: dict = {}
    for p in cfg.param_specs():
        dtype = spec_dtype(p, WORKSPACE_DTYPE)  # packed int4 words stay int32, a float32 bias float32
        if dtype == jnp.float8_e4m3fn:
            dtype = FP8_AS_BYTES
        set_path(params, p.name, jax.ShapeDtypeStruct(p.shape, dtype, sharding=get_path(param_shardings, p.name)))
    # Each cache group's pages: enough for the largest bucket's page tables (the temporaries do
    # not grow with the pool), a windowed group's as many as its rows' windows take, in whole
    # multiples of a split pages axis.
    multiple = _pages_split(cfg, cache_shardings)
    num_pages = {}
    for g in cfg.cache_groups():
        most = max(p.rows * g.pages_per_row(p.width * page_size, page_size, p.tokens) for p in programs)
        num_pages[g.name] = -(-most // multiple) * multiple
    pages = {
        c.name: jax.ShapeDtypeStruct(
            c.shape(num_pages[c.group], page_size), WORKSPACE_DTYPE, sharding=cache_shardings[c.name]
        )
        for c in cfg.cache_specs()
    }
    layer_stack = Pipeline(mesh, spec.num_microbatches) if mesh is not None and spec.pp > 1 else None
    parallel = Parallel(mesh) if mesh is not None and (spec.tp > 1 or spec.ep > 1) else None
    buckets = Buckets(
        tuple(p.rows for p in programs if p.kind == "decode"),
        tuple((p.rows, p.tokens) for p in programs if p.kind == "prefill"),
        max(p.width for p in programs),
    )
    # The sampler's penalty counts: one slot per row of the largest batch, and the scratch slot.
    slots = max(p.rows for p in programs) + 1
    counts_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else None
    penalties = PenaltyState(
        jax.ShapeDtypeStruct((slots, cfg.vocab_size), jnp.int32, sharding=counts_sharding),
        jax.ShapeDtypeStruct((slots, cfg.vocab_size), jnp.bool_, sharding=counts_sharding),
    )
    compiled = CompiledPrograms(
        cfg,
        params,
        pages,
        penalties,
        buckets,
        "reference",
        lazy=True,
        mesh=mesh,
        layer_stack=layer_stack,
        parallel=parallel,
    )

    def one(p: Program) -> dict:
        # Packed int4 experts as the GPU kernel tiles them (INT4_IMPL); the context is per
        # thread, so it is entered here.
        with int4_experts.use_impl(INT4_IMPL):
            if p.kind == "decode":
                exe = compiled.decode(p.rows)
            else:
                exe = compiled.prefill(p.rows, p.tokens)
        stats = exe.memory_analysis()
        temp = int(stats.temp_size_in_bytes)
        outputs = max(0, int(stats.output_size_in_bytes) - int(stats.alias_size_in_bytes))
        return {"temp_bytes": temp, "output_bytes": outputs, "workspace_bytes": temp + outputs}

    # XLA compiles outside the GIL: the two programs overlap.
    with ThreadPoolExecutor(len(programs)) as pool:
        return list(pool.map(one, programs))


def estimate_workspace(
    cfg: Family, param_shardings: dict, cache_shardings: dict, program: Program, page_size: int
) -> int:
    """The analytic stand-in for `measure_workspace`, in WORKSPACE_DTYPE (4-byte) values:
      one layer's weights on a device (a scanned layer's slices are materialised)
    + one layer's K and V of one block of pages per row (the reference attention gathers a
      block at a time)
    + logits and their softmax over the full vocabulary for every row
    + ACTIVATION_VALUES_PER_TOKEN x embed width for every token."""
    w = np.dtype(WORKSPACE_DTYPE).itemsize
    layer = layer_bytes(cfg, param_shardings, WORKSPACE_DTYPE)
    block = min(program.width, block_pages(page_size)) * page_size
    gathered = program.rows * block * kv_values_per_layer(cfg, cache_shardings) * w
    logits = 2 * program.rows * cfg.vocab_size * w
    embed = max((n for p in cfg.param_specs() for a, n in zip(p.axes, p.shape) if a == "embed"), default=0)
    activations = program.rows * program.tokens * embed * ACTIVATION_VALUES_PER_TOKEN * w
    return layer + gathered + logits + activations


# -- the KV pools -----------------------------------------------------------------------------------


def group_page_bytes(cfg: Family, mesh, cache_shardings: dict, page_size: int, dtype) -> dict[str, int]:
    """Bytes of one page of each cache group on the device holding the most of it: the engine's
    own figures (`jfire.runner.pool_size` sizes its pools with them)."""
    from jfire.kv_cache import page_bytes

    return {
        g.name: sharding.page_bytes_per_device(cfg, page_size, dtype, cache_shardings, g.name)
        if mesh is not None
        else page_bytes(cfg, page_size, dtype, g.name)
        for g in cfg.cache_groups()
    }


def kv_pools(
    cfg: Family,
    mesh,
    cache_shardings: dict,
    dtype,
    budget: int,
    *,
    page_size: int,
    max_batch: int,
    prefill_budget: int,
    max_model_len: int,
    shared: bool = False,
) -> tuple[dict[str, int], bool]:
    """(pages per cache group, shared) of the pools an engine sizes from `budget` bytes a
    device: `jfire.runner.pool_size` itself, given the model's config, KV dtype and mesh (each
    windowed group its rows' windows, the full-attention groups the rest: kv_cache.pool_pages;
    one pool for all where that holds no fewer pages of full attention, or where `shared`),
    for the most bytes of whole pages within the budget (the engine rounds a split pages axis
    up to whole multiples of the split). No pages where the budget holds none."""
    from jfire.engine_config import EngineConfig
    from jfire.runner import pool_size

    per_page = group_page_bytes(cfg, mesh, cache_shardings, page_size, dtype)
    step = _pages_split(cfg, cache_shardings) * sum(per_page.values())
    nbytes = budget
    while nbytes >= sum(per_page.values()):
        config = EngineConfig(
            page_size=page_size, kv_cache_bytes=nbytes, max_batch=max_batch, prefill_budget=prefill_budget
        )
        counts, one_pool = pool_size(cfg, dtype, mesh, config, max_model_len, shared)
        used = pool_bytes(counts, per_page)
        if used <= budget:
            return counts, one_pool
        nbytes = min(nbytes, used) - step
    return dict.fromkeys(per_page, 0), False


def pool_bytes(counts: dict[str, int], per_page: dict[str, int]) -> int:
    return sum(n * per_page[name] for name, n in counts.items())


# -- the plan ---------------------------------------------------------------------------------------


def plan(
    model: str | Path,
    spec: meshes.MeshSpec,
    *,
    dtype: str = "bfloat16",
    limits: Limits = Limits(),
    compile: bool = True,
    device_memory_gib: float | None = None,
    device_memory_source: str | None = None,
    devices=None,
    usd_per_device_hour: float | None = None,
    kv_dtype: str | None = None,
) -> dict:
    """The memory plan of `model` on `spec` as a JSON-ready dict (see `format_plan`), with its
    throughput and cost on paper where the mesh gives the device's peaks. `kv_dtype`: the KV
    cache's dtype where it is not the weights' (bfloat16 weights on one CPU device keep a
    float32 cache: `LoadedModel.kv_dtype`); `device_memory_source` names where a given
    `device_memory_gib` came from (serve and launch: the device's allocator, jfire.device_memory)."""
    from jfire.engine import EngineConfig
    from jfire.programs import Buckets
    from jfire.request_checks import context_limit

    if dtype not in DTYPES:
        raise JfireError(f"unknown dtype {dtype!r}; use one of: {', '.join(DTYPES)}")
    kind, memory_gib, memory_source = device_memory(spec, device_memory_gib)
    if device_memory_source is not None and device_memory_gib is not None:
        memory_source = device_memory_source
    kv_dtype = kv_dtype or dtype
    if kv_dtype not in DTYPES:
        raise JfireError(f"unknown KV cache dtype {kv_dtype!r}; use one of: {', '.join(DTYPES)}")
    engine = EngineConfig()
    max_batch = _at_least("--max-batch", limits.max_batch, engine.max_batch, 1)
    prefill_budget = _at_least("--prefill-budget", limits.prefill_budget, engine.prefill_budget, 16)
    if usd_per_device_hour is not None and not usd_per_device_hour > 0:
        raise JfireError(f"--usd-per-device-hour must be > 0, got {usd_per_device_hour}")
    if limits.max_context is not None and limits.max_context < 2:
        raise JfireError(f"--max-context must be >= 2 (a prompt token and a generated one), got {limits.max_context}")
    cfg = read_model_config(model)
    devices = list(devices if devices is not None else jax.devices())
    meshes.check_fits(spec, cfg, len(devices))
    mesh = meshes.build(spec, devices) if spec.size > 1 else None
    wide, replication = cfg.adapt_to_tp(spec.tp) if mesh is not None else (cfg, 1)
    param_shardings, cache_shardings = _shardings(wide, mesh, devices[0])
    if mesh is not None:
        order = [(dict(zip(mesh.axis_names, map(int, at))), mesh.devices[at]) for at in np.ndindex(mesh.devices.shape)]
    else:
        order = [({a: 0 for a in meshes.AXES}, devices[0])]

    weights = weight_bytes(wide, param_shardings, DTYPES[dtype])
    kv = kv_bytes_per_token(wide, cache_shardings, DTYPES[kv_dtype])
    page_size = engine.page_size
    max_model_len = context_limit(wide, limits.max_context)
    buckets = Buckets.for_limits(
        max_batch=max_batch,
        prefill_budget=prefill_budget,
        max_prefill_rows=engine.max_prefill_rows,
        max_pages_per_row=-(-max_model_len // page_size),
        page_size=page_size,
    )
    programs = largest_programs(buckets)
    kv_device = max(kv.values())
    estimates = [estimate_workspace(wide, param_shardings, cache_shardings, p, page_size) for p in programs]
    if compile:
        measured = measure_workspace(
            wide, param_shardings, cache_shardings, programs, mesh=mesh, spec=spec, page_size=page_size
        )
    else:
        measured = [None] * len(programs)
    details = []
    for p, est, m in zip(programs, estimates, measured):
        details.append(
            {
                "program": p.kind,
                "rows": p.rows,
                "tokens_per_row": p.tokens,
                "pages_per_row": p.width,
                "estimate_bytes": est,
                **(m or {}),
            }
        )
    workspace = max(d["workspace_bytes"] if compile else d["estimate_bytes"] for d in details)

    memory = int(round(memory_gib * GIB))
    per_device = []
    for i, (coords, device) in enumerate(order):
        free = memory - weights[device] - workspace - RESERVE_BYTES
        per_device.append(
            {
                "index": i,
                "mesh_coords": coords,
                "memory_bytes": memory,
                "weight_bytes": weights[device],
                "workspace_bytes": workspace,
                "reserve_bytes": RESERVE_BYTES,
                "kv_bytes_free": free,
                "kv_bytes_per_token": kv[device],
            }
        )
    free_total = sum(d["kv_bytes_free"] for d in per_device)
    kv_total = sum(d["kv_bytes_per_token"] for d in per_device)
    # The pools: every device holds its share of each page (all of it, or 1/n of the pages where
    # they are split n ways), so the device with the least room bounds them; sized as the engine
    # sizes them from that many bytes a device (`kv_pools`).
    budget = max(0, min(d["kv_bytes_free"] for d in per_device))
    groups = wide.cache_groups()
    kv_type = DTYPES[kv_dtype]
    per_page = group_page_bytes(wide, mesh, cache_shardings, page_size, kv_type)
    pools = functools.partial(
        kv_pools,
        wide,
        mesh,
        cache_shardings,
        kv_type,
        page_size=page_size,
        max_batch=max_batch,
        prefill_budget=prefill_budget,
        max_model_len=max_model_len,
    )
    group_pages, shared = pools(budget)
    kv_cache_bytes = pool_bytes(group_pages, per_page)  # per device: what the engine is given
    one_pool = pools(kv_cache_bytes, shared=True)[0]
    full = [g for g in groups if not g.windowed]
    pages = max(group_pages[g.name] for g in full or groups)  # what EngineConfig.num_pages means: a full group's
    capacity = pages * page_size
    step_tokens = max(prefill_budget, 2)  # as the engine steps its rows (jfire.runner.pool_size)
    row_pages = {g.name: g.pages_per_row(max_model_len, page_size, step_tokens) for g in groups}
    per_sequence = max_model_len
    for g in groups:
        if not g.windowed or group_pages[g.name] < row_pages[g.name]:  # a window that fits slides on
            per_sequence = min(per_sequence, group_pages[g.name] * page_size)
    kv_groups = {
        g.name: {
            "attends": "chunk" if g.chunk else "sliding window" if g.sliding_window else "all",
            "window": g.chunk or g.sliding_window,
            "pages": group_pages[g.name],
            "pages_per_row": row_pages[g.name],
            "page_bytes_per_device": per_page[g.name],
            "bytes_per_device": group_pages[g.name] * per_page[g.name],
            "kv_bytes_per_token": sum(kv_bytes_per_token(wide, cache_shardings, kv_type, g.name).values()),
        }
        for g in groups
    }
    # One full context beside every row's window (a windowed group's rows, a full group's one
    # row), or in one pool (each group a whole row): the least bytes a device needs to fit one;
    # where every group is windowed, one row's windows.
    whole = -(-max_model_len // page_size)
    by_kind = sum((max_batch * row_pages[g.name] if g.windowed else whole) * per_page[g.name] for g in groups)
    context_bytes = min(by_kind, whole * sum(per_page.values()))
    if not full:
        context_bytes = sum(row_pages[g.name] * per_page[g.name] for g in groups)
    kv_model = cfg.kv_bytes_per_token(kv_type)  # the cache declaration's, each layer once
    problems = []
    if min(d["kv_bytes_free"] for d in per_device) <= 0:
        problems.append("the weights, workspace and reserve leave no memory for the KV cache")
    elif per_sequence < max_model_len:  # whole pages: a row takes its last page whole
        several = len(groups) > 1
        problems.append(
            f"the KV cache holds {per_sequence} tokens ({pages} pages of {page_size}"
            + (" in each full-attention group's pool, beside every row's window" if several else "")
            + f"), less than one sequence of the {max_model_len}-token context (lower --max-context"
            + (", --max-batch or --prefill-budget" if several else "")
            + ", or use a bigger mesh)"
        )
    counts = parameter_counts(cfg, DTYPES[dtype])
    peaks = throughput.Device.of(spec)
    speed = None
    if peaks is not None:
        once, tick = step_passes(wide, param_shardings, DTYPES[dtype], spec.pp)
        speed = throughput.figures(
            throughput.model_on_mesh(wide, once, tick, param_shardings, cache_shardings, spec, kv_device),
            peaks,
            devices=len(per_device),
            kind=kind,
            max_batch=max_batch,
            context=max_model_len,
            prefill_chunk=prefill_budget,
            max_prompt=wide.to_dict()["max_position_embeddings"],
            usd_per_device_hour=usd_per_device_hour,
        )
    return {
        "model": str(model),
        "family": cfg.family,
        "architecture": getattr(cfg, "architecture", None),
        "dtype": dtype,
        "parameters": counts["parameters"],
        "parameter_bytes": counts["parameter_bytes"],
        "int4_parameters": counts["int4_parameters"],
        "int4_bytes": counts["int4_bytes"],
        "fp8_parameters": counts["fp8_parameters"],
        "fp8_bytes": counts["fp8_bytes"],
        "scale_bytes": counts["scale_bytes"],
        "parameters_note": (
            f"weights, each in its own dtype ({dtype} unless declared otherwise)"
            + (
                "; int4 weights counted one each (8 per int32 word, 4 bits a weight)"
                if counts["int4_parameters"]
                else ""
            )
            + ("; FP8 experts' weights one byte each (float8_e4m3fn)" if counts["fp8_parameters"] else "")
            + (
                "; their quantization scales are bytes (scale_bytes), not parameters, and are in "
                "parameter_bytes and the weights per device"
                if counts["scale_bytes"]
                else ""
            )
        ),
        "mesh": {
            "name": spec.name,
            "dp": spec.dp,
            "pp": spec.pp,
            "tp": spec.tp,
            "ep": spec.ep,
            "microbatches": spec.num_microbatches if spec.pp > 1 else None,
        },
        "devices": len(per_device),
        "device_kind": kind,
        "device_memory_gib": memory_gib,
        "device_memory_bytes": memory,
        "device_memory_source": memory_source,
        "kv_head_replication": replication,
        "weight_bytes_per_device": max(d["weight_bytes"] for d in per_device),
        "weight_bytes_total": sum(d["weight_bytes"] for d in per_device),
        "workspace_bytes_per_device": workspace,
        "workspace_source": "measured" if compile else "estimate",
        "workspace_note": (
            f"on XLA:CPU, memory_analysis() of the largest programs compiled with "
            f"{np.dtype(WORKSPACE_DTYPE).name} weights and cache (4-byte values: meant as an upper bound for a GPU)"
            + (
                f"; int4 experts packed in int32 words, multiplied as the GPU kernel tiles them (impl {INT4_IMPL!r})"
                if counts["int4_parameters"]
                else ""
            )
            + (
                "; FP8 experts held as their bytes, each layer's dequantized in its step (float32 here, "
                "bf16 on a GPU) and multiplied by expert in lax loops, not XLA:CPU's dense ragged_dot"
                if counts["fp8_parameters"]
                else ""
            )
            if compile
            else "a stated formula, nothing compiled: one layer's weights + one layer's gathered K/V "
            f"for every row + logits + {ACTIVATION_VALUES_PER_TOKEN} x embed per token, in 4-byte "
            "values"
        ),
        "workspace_programs": details,
        "reserve_bytes_per_device": RESERVE_BYTES,
        "reserve_note": "a stated constant: CUDA context, library workspaces, allocator slack",
        "kv_bytes_per_token": kv_total,
        "kv_bytes_per_token_model": kv_model,
        "kv_note": (
            "kv_bytes_per_token: what one token in every layer costs summed over the devices (KV heads "
            "repeated for tp and layers kept on every pipeline stage counted each time they are stored; "
            "kv_groups gives each cache group's share); kv_bytes_per_token_model: the cache declaration's, "
            "each layer once"
        ),
        "kv_bytes_free_total": free_total,
        "kv_budget_bytes_per_device": budget,
        "kv_capacity_tokens": capacity,
        "max_tokens_per_sequence": per_sequence,
        "kv_capacity_note": (
            "kv_capacity_tokens: the tokens of context the pools hold once every row's window is reserved "
            "(each windowed group --max-batch rows of the most pages a row holds of it at once): a full-attention "
            "group's pages x page_size, or, where every group is windowed, their pages x page_size; "
            "max_tokens_per_sequence: the most one sequence may hold (at most --max-context); kv_groups: "
            "each cache group's pool (pages, the bytes of a page and of the pool on the device with the "
            "least room, the most pages one row holds at once)"
        ),
        "page_size": page_size,
        "kv_pages": pages,
        "kv_groups": kv_groups,
        "kv_pools_shared": shared,
        "kv_pages_one_pool": max(one_pool.values()),
        "kv_context_bytes_per_device": context_bytes,
        "kv_cache_gb_per_device": math.floor(kv_cache_bytes / GIB * 100) / 100,
        "kv_cache_bytes_per_device": kv_cache_bytes,
        "kv_dtype": kv_dtype,
        "max_context": max_model_len,
        "max_batch": max_batch,
        "prefill_budget": prefill_budget,
        "fits": not problems,
        "problems": problems,
        "per_device": per_device,
        "throughput": speed,
    }


def _at_least(flag: str, value: int | None, default: int, low: int) -> int:
    if value is None:
        return default
    if value < low:
        raise JfireError(f"{flag} must be >= {low}, got {value}")
    return value


# -- printing ---------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    """GiB with two decimals; smaller sizes (tiny models) in MiB or KiB so they do not read as 0."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.2f} KiB"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(n)


def _kv_model(p: dict) -> str:
    """The model's own bytes per token, where the mesh stores more (repeated or per-stage)."""
    model = p.get("kv_bytes_per_token_model")
    if model is None or model == p["kv_bytes_per_token"]:
        return ""
    return f" (the model's cache: {_kib(model)}, each layer once; the rest is stored again on other devices)"


def _quantized_line(p: dict) -> str:
    """The parameters line's tail: the weights held quantized, beside their scales."""
    parts = []
    if p.get("int4_parameters"):
        parts.append(f"{p['int4_parameters']:,} int4 weights ({_gib(p['int4_bytes'])}, 8 per int32 word)")
    if p.get("fp8_parameters"):
        parts.append(f"{p['fp8_parameters']:,} FP8 weights ({_gib(p['fp8_bytes'])}, a byte each)")
    if not parts:
        return ""
    return f", except {' and '.join(parts)} and their scales ({_gib(p['scale_bytes'])}: bytes, not parameters)"


def _throughput_lines(p: dict) -> list[str]:
    """The plan's throughput and cost on paper, in a few lines (jfire/throughput.py)."""
    t = p.get("throughput")
    if t is None:
        return ["throughput  not on paper: the mesh file's [device] table gives no memory_tb_per_s and bf16_tflops"]
    a = t["assumptions"]
    link = f", link {a['link_bytes_per_s'] / 1e9:g} GB/s" if a["link_bytes_per_s"] else ""
    head = (
        f"throughput  bounds on paper (docs/plan.md): {a['device'] or 'a device'} at "
        f"{a['memory_bytes_per_s'] / 1e12:g} TB/s, {a['bf16_flops_per_s'] / 1e12:g} bf16 TFLOP/s{link}; "
        f"{a['devices_reading_at_once']} devices read at once"
    )
    if a["pipeline_ticks"]:
        head += (
            f" per stage, a step of b rows in m + {p['mesh']['pp'] - 1} ticks of b/m "
            f"(m micro-batches, at most {p['mesh']['microbatches']})"
        )
    usd = t["usd_per_million_output_tokens"]
    price = f"${a['usd_per_device_hour']:g} per device-hour" + (
        ", the default: --usd-per-device-hour" if a["usd_per_device_hour_source"] == "default" else ""
    )
    lines = [
        head,
        f"decode      tok/s ($ per M output tokens at {price}), rows {a['kv_context_tokens']:,} tokens deep: "
        + ", ".join(f"batch {b}: {n:,.0f} (${usd[b]:.2f})" for b, n in t["decode_tokens_per_s"].items()),
    ]
    if t["ttft_s"]:
        lines.append(
            f"prefill     TTFT, one prompt in {a['prefill_chunk_tokens']}-token chunks, FLOPs at "
            f"{a['efficiency']['prefill_flops']:.0%} of peak: "
            + ", ".join(
                f"{int(n):,} tokens {s:.3g} s ({t['prefill_tokens_per_s'][n]:,.0f} tok/s)"
                for n, s in t["ttft_s"].items()
            )
        )
    if a["experts_touched_per_layer"]:
        lines.append(
            f"experts     touched per layer, of {a['experts']} (top-{a['experts_per_token']})"
            + (", a micro-batch's rows at a time" if a["pipeline_ticks"] else "")
            + ": "
            + ", ".join(f"{n:.1f} at batch {b}" for b, n in a["experts_touched_per_layer"].items())
        )
    return lines


def _tightest(p: dict) -> dict:
    """The device with the least room for the KV cache."""
    return min(p["per_device"], key=lambda d: d["kv_bytes_free"])


def _memory_sum(p: dict, d: dict) -> str:
    """Device d's memory, less what the plan takes from it, in words and figures."""
    return (
        f"device memory {_gib(d['memory_bytes'])} (from {p['device_memory_source']}) - weights "
        f"{_gib(d['weight_bytes'])} - workspace {_gib(d['workspace_bytes'])} ({p['workspace_source']}: "
        f"--max-batch {p['max_batch']}, --prefill-budget {p['prefill_budget']}) - reserve "
        f"{_gib(d['reserve_bytes'])} leaves {_gib(d['kv_bytes_free'])} for the KV cache"
    )


def _groups(p: dict) -> dict:
    """The plan's pools by cache group worth a line each: all of them where there are several or
    one is windowed; none for one pool of full attention (the plan says it all)."""
    groups = p.get("kv_groups") or {}
    return groups if len(groups) > 1 or any(g["window"] for g in groups.values()) else {}


def _pages(p: dict, noun: str = "pages") -> str:
    """The pools' pages in words: "N pages of 16", each group's where there are several."""
    text = f"{p['kv_pages']:,} {noun} of {p['page_size']}"
    groups = _groups(p)
    if len(groups) < 2:
        return text
    if p["kv_pools_shared"]:
        return f"{text} in one pool for the {' and '.join(groups)} layers"
    return ", ".join(f"{g['pages']:,} {name}" for name, g in groups.items()) + f" {noun} of {p['page_size']}"


def format_pool(p: dict) -> str:
    """The pools a plan that fits gives an engine, in one line (serve and launch with
    `--kv-cache-gb auto` print it at start-up)."""
    d = _tightest(p)
    one_pool = (
        f"; an engine keeping one pool (moving pages by id): {p['kv_pages_one_pool']:,} pages for every group"
        if len(_groups(p)) > 1 and not p["kv_pools_shared"]
        else ""
    )
    return (
        f"{_pages(p, 'KV pages')} tokens, {_gib(p['kv_cache_bytes_per_device'])} per device "
        f"({p['kv_capacity_tokens'] / p['max_context']:.1f} contexts of {p['max_context']:,}{one_pool}): "
        + _memory_sum(p, d)
    )


def format_refusal(p: dict) -> str:
    """Why a plan does not fit, as one paragraph with its figures, for the device with the least
    room: what `jfire serve` and `launch` say when `--kv-cache-gb auto` refuses to start."""
    d = _tightest(p)
    where = (
        f"device {d['index']} of the {p['devices']} of mesh {p['mesh']['name']!r}" if p["devices"] > 1 else "one device"
    )
    groups = _groups(p)
    windows = (
        ", beside every row's window of the "
        + " and ".join(name for name, g in groups.items() if g["window"])
        + " layers,"
        if len(groups) > 1
        else ""
    )
    a_token = (
        " and ".join(
            f"{_kib(g['page_bytes_per_device'] // p['page_size'])} a token in the {name} layers"
            for name, g in groups.items()
        )
        if groups
        else f"{_kib(d['kv_bytes_per_token'])} a token"
    )
    return (
        f"{p['model']} ({p['dtype']}) does not fit {where} with room for one full context: "
        + _memory_sum(p, d)
        + f", and one {p['max_context']:,}-token context{windows} needs {_gib(p['kv_context_bytes_per_device'])} "
        f"({a_token}). Lower --max-context, --max-batch or --prefill-budget, "
        + ("load the weights in bfloat16 (--dtype), " if p["dtype"] != "bfloat16" else "")
        + "spread the model over more devices (--mesh), or state the devices' memory with --device-memory-gib "
        "if they have more (jfire plan --no-compile prints the same figures)"
    )


def _group_line(p: dict, name: str, g: dict) -> str:
    """One cache group's pool: its pages, their bytes, and what its layers attend."""
    if g["attends"] == "all":
        attends = "every earlier position"
    else:
        what = "chunks" if g["attends"] == "chunk" else "a sliding window"
        step = f"with a {p['prefill_budget']}-token step"
        attends = (
            f"{what} of {g['window']:,} tokens, {p['max_batch']} rows x {g['pages_per_row']:,} pages "
            f"(the most a row holds at once, {step})"
            if g["pages"] == p["max_batch"] * g["pages_per_row"]
            else f"{what} of {g['window']:,} tokens, a row at most {g['pages_per_row']:,} pages at once ({step})"
        )
    return (
        f"            {name}: {g['pages']:,} pages, {_gib(g['bytes_per_device'])} per device, "
        f"{_kib(g['kv_bytes_per_token'])} per token over all devices; its layers attend {attends}"
    )


def format_plan(p: dict) -> str:
    mesh = p["mesh"]
    axes = " ".join(f"{a}={mesh[a]}" for a in ("dp", "pp", "tp", "ep"))
    devices = f"{p['devices']} x {p['device_kind']}" if p["device_kind"] else f"{p['devices']} devices"
    lines = [
        f"model       {p['model']} ({p['family']}, {p['architecture']})",
        f"parameters  {p['parameters']:,} ({_count(p['parameters'])}), {_gib(p['parameter_bytes'])}: {p['dtype']}"
        + _quantized_line(p),
        f"mesh        {mesh['name']} ({axes}): {devices}, {p['device_memory_gib']:g} GiB each "
        f"(from {p['device_memory_source']})",
    ]
    if p["kv_head_replication"] > 1:
        lines.append(f"kv heads    repeated {p['kv_head_replication']}x so each tp shard owns one (counted below)")
    lines += [
        "",
        f"{'device':<8}{'memory':>12}{'weights':>13}{'workspace':>13}{'reserve':>12}{'KV free':>12}{'KV/token':>11}",
    ]
    for d in p["per_device"]:
        lines.append(
            f"{d['index']:<8}{_gib(d['memory_bytes']):>12}{_gib(d['weight_bytes']):>13}"
            f"{_gib(d['workspace_bytes']):>13}{_gib(d['reserve_bytes']):>12}{_gib(d['kv_bytes_free']):>12}"
            f"{_kib(d['kv_bytes_per_token']):>11}"
        )
    lines.append("")
    source = p["workspace_source"]
    lines.append(f"workspace   {_gib(p['workspace_bytes_per_device'])} per device, {source}: {p['workspace_note']}")
    for d in p["workspace_programs"]:
        shape = f"{d['program']} {d['rows']} x {d['tokens_per_row']} tokens, {d['pages_per_row']} pages/row"
        measured = (
            f"measured {_gib(d['workspace_bytes'])} (temp {_gib(d['temp_bytes'])} + outputs "
            f"{_gib(d['output_bytes'])}), "
            if "workspace_bytes" in d
            else ""
        )
        lines.append(f"              {shape}: {measured}estimate {_gib(d['estimate_bytes'])}")
    lines.append(f"reserve     {_gib(p['reserve_bytes_per_device'])} per device, {p['reserve_note']}")
    groups = _groups(p)
    lines += [
        "",
        f"KV cache    {_gib(p['kv_bytes_free_total'])} free in all; {_kib(p['kv_bytes_per_token'])} per token over all "
        f"devices{_kv_model(p)} -> {p['kv_capacity_tokens']:,} tokens "
        f"({p['kv_capacity_tokens'] / p['max_context']:.1f} sequences of {p['max_context']:,})"
        + (", a pool per kind of layer, every row's window reserved:" if len(groups) > 1 else ":" if groups else "")
        if p["kv_capacity_tokens"]
        else f"KV cache    no room ({_gib(p['kv_bytes_free_total'])} free in all)",
    ]
    if p["kv_capacity_tokens"]:
        lines += [_group_line(p, name, g) for name, g in groups.items()]
    if p["fits"]:
        lines.append(
            f"fits        yes: serve with --kv-cache-gb {p['kv_cache_gb_per_device']:g} "
            f"({_pages(p)}); limits: --max-batch {p['max_batch']} "
            f"--prefill-budget {p['prefill_budget']} --max-context {p['max_context']}"
        )
        lines.append(
            "            (on a GPU, serve and launch default to --kv-cache-gb auto: this arithmetic at start-up, "
            "the workspace estimated as by --no-compile; docs/plan.md)"
        )
    else:
        lines.append("fits        no: " + "; ".join(p["problems"]))
    return "\n".join(lines + _throughput_lines(p))
