"""`jfire plan`'s workspace: the temporaries of the largest compiled programs (the widest decode
bucket and the fullest prefill bucket), from XLA's `memory_analysis()` of programs lowered from
ShapeDtypeStructs on fake CPU devices (`measure_workspace`: nothing is allocated), or, with
`compile=False` (serve's `--kv-cache-gb auto` too), `estimate_workspace`'s stated formula.

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
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jfire import mesh as meshes
from jfire.kernels import int4_experts
from jfire.kernels.paged_attention import block_pages
from jfire.models.family import Family, Parallel
from jfire.models.params import get_path, set_path, spec_dtype
from jfire.plan_bytes import _pages_split, kv_values_per_layer, layer_bytes

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
