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
  vision      a multimodal model's vision tower and projector, whole on each process's first
              device, where the engine loads it (jfire/plan_vision.py); that device's
              workspace is the larger of the programs' and the image encoder's
  reserve     RESERVE_BYTES, a stated constant: CUDA context, library workspaces, allocator slack
  free        device memory - weights - vision - workspace - reserve: the room for the KV cache

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

The workspace is measured on XLA:CPU with float32 weights and cache, meant as an upper bound for
a GPU (jfire/plan_workspace.py says why).

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

The files: this one reads the inputs and puts the plan together (`plan`); jfire/plan_bytes.py
counts the bytes of weights and cache on each device and what a step reads (`step_passes`);
jfire/plan_workspace.py measures or estimates the workspace; jfire/plan_vision.py counts the
vision tower and its encoder's workspace; jfire/plan_pools.py sizes the KV pools and gives their
fields; jfire/plan_format.py prints a plan, its pools and its refusal. Their
public names are importable from here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from jfire import mesh as meshes
from jfire import throughput
from jfire.checkpoint.load import DTYPES
from jfire.errors import JfireError
from jfire.models.family import Family
from jfire.plan_bytes import (
    GIB,
    _shardings,
    kv_bytes_per_token,
    kv_values_per_layer,
    layer_bytes,
    parameter_counts,
    shard_bytes,
    step_passes,
    weight_bytes,
    weights_held,
)
from jfire.plan_format import format_plan, format_pool, format_refusal
from jfire.plan_pools import group_page_bytes, kv_pool_fields, kv_pools, pool_bytes
from jfire.plan_vision import (
    VisionTower,
    estimate_encoder_workspace,
    holders,
    measure_encoder_workspace,
    read_vision_tower,
)
from jfire.plan_workspace import (
    ACTIVATION_VALUES_PER_TOKEN,
    FP8_AS_BYTES,
    INT4_IMPL,
    WORKSPACE_DTYPE,
    Program,
    estimate_workspace,
    largest_programs,
    measure_workspace,
)

__all__ = [
    "ACTIVATION_VALUES_PER_TOKEN",
    "FP8_AS_BYTES",
    "GIB",
    "INT4_IMPL",
    "RESERVE_BYTES",
    "WORKSPACE_DTYPE",
    "Limits",
    "Program",
    "VisionTower",
    "device_memory",
    "estimate_encoder_workspace",
    "estimate_workspace",
    "format_plan",
    "format_pool",
    "format_refusal",
    "group_page_bytes",
    "kv_bytes_per_token",
    "kv_pool_fields",
    "kv_pools",
    "kv_values_per_layer",
    "largest_programs",
    "layer_bytes",
    "measure_encoder_workspace",
    "measure_workspace",
    "parameter_counts",
    "plan",
    "pool_bytes",
    "read_model_config",
    "read_vision_tower",
    "shard_bytes",
    "step_passes",
    "weight_bytes",
    "weights_held",
]

# Per device, beyond what XLA allocates: the CUDA context (typically ~0.5 GiB), cuBLAS/cuDNN
# workspaces and the allocator's fragmentation. A stated constant, not a measurement.
RESERVE_BYTES = 1 * GIB


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
    vision: bool = True,
) -> dict:
    """The memory plan of `model` on `spec` as a JSON-ready dict (see `format_plan`), with its
    throughput and cost on paper where the mesh gives the device's peaks. `kv_dtype`: the KV
    cache's dtype where it is not the weights' (bfloat16 weights on one CPU device keep a
    float32 cache: `LoadedModel.kv_dtype`); `device_memory_source` names where a given
    `device_memory_gib` came from (serve and launch: the device's allocator, jfire.device_memory).
    `vision`: whether the engine holds the model's image encoder, if it has one (an engine that
    prefills does; a disaggregated decode group does not): jfire/plan_vision.py."""
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
    tower = read_vision_tower(model) if vision else None
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
    # The image encoder (jfire/plan_vision.py): whole on each process's first device; the first
    # of them runs it, between the programs, so that device needs the larger workspace of the two.
    held, encoder, encoder_bytes = [], None, 0
    if tower is not None:
        held = holders(spec, [device for _, device in order])
        encoder = {
            "estimate_bytes": estimate_encoder_workspace(tower),
            **(measure_encoder_workspace(tower) if compile else {}),
        }
        encoder_bytes = encoder["workspace_bytes"] if compile else encoder["estimate_bytes"]
    vision_bytes = tower.param_bytes(DTYPES[dtype]) if tower is not None else 0

    memory = int(round(memory_gib * GIB))
    per_device = []
    for i, (coords, device) in enumerate(order):
        tower_bytes = vision_bytes if device in held else 0
        encodes = encoder_bytes if held and device == held[0] else 0
        counted = max(workspace, encodes)
        free = memory - weights[device] - tower_bytes - counted - RESERVE_BYTES
        per_device.append(
            {
                "index": i,
                "mesh_coords": coords,
                "memory_bytes": memory,
                "weight_bytes": weights[device],
                "vision_param_bytes": tower_bytes,
                "workspace_bytes": counted,
                "encoder_workspace_bytes": encodes,
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
    kv_type = DTYPES[kv_dtype]
    pools = kv_pool_fields(
        wide,
        mesh,
        cache_shardings,
        kv_type,
        budget,
        page_size=page_size,
        max_batch=max_batch,
        prefill_budget=prefill_budget,
        max_model_len=max_model_len,
    )
    kv_model = cfg.kv_bytes_per_token(kv_type)  # the cache declaration's, each layer once
    problems = []
    if min(d["kv_bytes_free"] for d in per_device) <= 0:
        problems.append(
            "the weights, "
            + ("the vision tower, " if tower is not None else "")
            + "workspace and reserve leave no memory for the KV cache"
        )
    elif pools["max_tokens_per_sequence"] < max_model_len:  # whole pages: a row takes its last page whole
        several = len(pools["kv_groups"]) > 1
        problems.append(
            f"the KV cache holds {pools['max_tokens_per_sequence']} tokens ({pools['kv_pages']} pages of {page_size}"
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
        "vision_parameters": tower.parameters() if tower is not None else 0,
        "vision_param_bytes": vision_bytes,
        "encoder_workspace_bytes": encoder_bytes,
        "vision": _vision_fields(tower, encoder, held, order, dtype, compile),
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
        **pools,
        "kv_dtype": kv_dtype,
        "max_context": max_model_len,
        "max_batch": max_batch,
        "prefill_budget": prefill_budget,
        "fits": not problems,
        "problems": problems,
        "per_device": per_device,
        "throughput": speed,
    }


def _vision_fields(tower: VisionTower | None, encoder: dict | None, held: list, order: list, dtype: str, compile: bool):
    """The plan's `vision` object: the tower, where it lives, and its largest encoder call; None
    for a model without one (or an engine that does not hold it)."""
    if tower is None:
        return None
    index = {device: i for i, (_, device) in enumerate(order)}
    return {
        "family": tower.family,
        "parameters": tower.parameters(),
        "param_bytes": tower.param_bytes(DTYPES[dtype]),
        "dtype": dtype,
        "devices": [index[d] for d in held],
        "encoder_device": index[held[0]],
        "placement_note": (
            "the vision tower and projector, whole, on each process's first device (the engine's default "
            "device: jfire.runner.load_vision), not split or replicated over the mesh; the first of them "
            "runs the encoder"
        ),
        "encoder_call": tower.call,
        "encoder_workspace_source": "measured" if compile else "estimate",
        **(encoder or {}),
        "encoder_note": (
            "temporaries + outputs + pixel inputs of the largest call for one image"
            + (
                f", from XLA:CPU's memory_analysis() of the encode compiled with {np.dtype(WORKSPACE_DTYPE).name} "
                "weights (an upper bound for a GPU)"
                if compile
                else ", a stated formula in 4-byte values (jfire/plan_vision.py)"
            )
            + "; it runs between the programs, never beside one, so its device counts the larger of the two "
            "workspaces; a step's new images are encoded in one call, counted here as one image"
        ),
    }


def _at_least(flag: str, value: int | None, default: int, low: int) -> int:
    if value is None:
        return default
    if value < low:
        raise JfireError(f"{flag} must be >= {low}, got {value}")
    return value
