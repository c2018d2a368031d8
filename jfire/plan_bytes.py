"""`jfire plan`'s bytes per device: what a model's parameters and paged cache take on each device
of a mesh, counted from abstract shardings, nothing allocated (jfire/plan.py puts them together).

  weights     each parameter's shard on that device (`devices_indices_map`), exact, in the
              param's own dtype (`spec_dtype`: packed int4 words int32, a router bias float32)
  KV cache    one token's cache on each device (`kv_bytes_per_token`), a pages axis split over n
              devices counted as 1/n of a page, an array kept on every pipeline stage on each

and what one device reads and multiplies of its weights in a step (`step_passes`), for the
throughput on paper (jfire/throughput.py).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jfire import sharding, throughput
from jfire.models.family import Family
from jfire.models.params import ParamSpec, get_path, set_path, spec_dtype

GIB = 1 << 30


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
