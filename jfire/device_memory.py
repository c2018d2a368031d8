"""Device memory from the plan: `jfire serve` and `jfire launch` with `--kv-cache-gb auto`.

`jfire plan` works out, per device, the weights, the workspace of the largest programs and a
reserve, and the room left for the KV cache (jfire/plan.py). With `--kv-cache-gb auto` serve and
each group of a launch size their page pool with that same function, `plan.plan`, for the
model, mesh, dtype and limits they run with, on the devices they run on, before a weight is
read: the engine is given the bytes of the plan's pools (`kv_cache_bytes_per_device`), from
which it sizes exactly the plan's pools (`jfire.runner.pool_size`, the function the plan sizes
them with: a pool per kind of layer, or one pool for every group where the engine moves pages by
id, each then as many pages as those bytes hold), and a model that leaves no room for one full
context is refused at start-up with the figures (`plan.format_refusal`).

- Auto is the default on accelerators; on CPU devices the default stays 1 GiB (host memory,
  shared with everything else on the machine, has no figure to plan from).
- The workspace is the plan's stated formula (`jfire plan --no-compile`): measuring it would
  compile the two largest programs a second time, in float32, at every start-up.
- Device memory: `--device-memory-gib`, else what JAX's allocator may use on each device of the
  mesh (`memory_stats()["bytes_limit"]`, the least of them). CPU devices report none, so auto
  there needs the flag (which is how the tests state a device's memory).
- JAX's allocator (`allocator_env`) is set before JAX starts its backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping

from jfire.errors import JfireError

AUTO = "auto"
GIB = 1 << 30
CPU_DEFAULT_BYTES = 1 * GIB  # --kv-cache-gb left out on CPU devices

# JAX's GPU allocator reads these when it starts its backend (jaxlib's
# generate_pjrt_gpu_plugin_options); any one of them set by the user leaves all of them alone.
USER_ALLOCATOR_VARS = (
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
)
# By default JAX preallocates 75% of a GPU for its allocator, so a pool sized to the plan's room
# (all of the device but the reserve) would not fit in it. Instead the allocator grows as the
# weights, the pool and the programs' temporaries need, up to 99% of the device: its limit, the
# `bytes_limit` the plan then starts from, the plan's reserve (CUDA context, library workspaces,
# fragmentation) left unallocated inside it. Not 100%: XLA gives the collective-memory
# allocator the rest (1 - fraction), which must not be nothing.
PLAN_ALLOCATOR = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_CLIENT_MEM_FRACTION": "0.99"}


def kv_cache_gb(text: str) -> float | str:
    """`--kv-cache-gb`: GiB per device, or "auto"."""
    if text == AUTO:
        return AUTO
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or 'auto', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or 'auto'), got {text}")
    return value


def allocator_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables serve and launch set before JAX starts (PLAN_ALLOCATOR): none where the
    user set any of JAX's allocator variables, or asked JAX for CPU devices only."""
    if any(name in environ for name in USER_ALLOCATOR_VARS):
        return {}
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and set(platforms) <= {"cpu"}:
        return {}
    return dict(PLAN_ALLOCATOR)


def use_plan_allocator() -> dict[str, str]:
    """Sets `allocator_env` in this process (and so in the processes it starts): must run
    before JAX starts its backend, which reads them once. Returns what it set."""
    env = allocator_env(os.environ)
    os.environ.update(env)
    return env


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """What the command line asked of the pool: `gb` is --kv-cache-gb (GiB, AUTO, or None when
    left out: auto on accelerators, 1 GiB on CPU devices), with --device-memory-gib."""

    gb: float | str | None = None
    device_memory_gib: float | None = None

    def __post_init__(self):
        if self.device_memory_gib is not None:
            if not self.device_memory_gib > 0:
                raise JfireError(f"--device-memory-gib must be > 0, got {self.device_memory_gib}")
            if self.gb not in (None, AUTO):
                raise JfireError(
                    "--device-memory-gib goes with --kv-cache-gb auto (it states the memory the plan "
                    f"sizes the pool from); drop it, or --kv-cache-gb {self.gb:g}"
                )

    @classmethod
    def of(cls, args) -> PoolSize:
        return cls(args.kv_cache_gb, getattr(args, "device_memory_gib", None))

    def auto(self, platform: str) -> bool:
        """Whether the plan sizes the pool on devices of `platform`."""
        if self.gb is None:  # left out: auto, but on CPU devices only if their memory is stated
            return platform != "cpu" or self.device_memory_gib is not None
        return self.gb == AUTO


def device_memory(devices) -> tuple[float, str]:
    """(GiB, where from) that JAX's allocator may use on each of `devices` (the least), from
    those of them this process holds; a JfireError where they report none (CPU devices)."""
    import jax

    here = [d for d in devices if d.process_index == jax.process_index()]
    if not here:
        raise JfireError(
            "--kv-cache-gb auto: this process holds none of the mesh's devices; give --device-memory-gib G"
        )
    limits = []
    for d in here:
        stats = d.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise JfireError(
                f"--kv-cache-gb auto needs --device-memory-gib G on {d.platform} devices: JAX reports no "
                f"memory limit for {d} (on a GPU it is the allocator's, memory_stats()['bytes_limit']); "
                "or give --kv-cache-gb a number"
            )
        limits.append(int(stats["bytes_limit"]))
    least = min(limits)
    return least / GIB, f"JAX's allocator limit on {here[limits.index(least)]}"


def size_pool(config, size: PoolSize, *, model: str, dtype: str, spec, devices, vision: bool = True):
    """`config` (a jfire.engine.EngineConfig) with its page pools sized as `size` asks on
    `devices` (the engine's, the mesh's first): by the plan where auto applies (the bytes of
    the plan's pools, from which the engine sizes the same pools; not `num_pages`, which would
    give every group of an engine keeping one pool the full-attention group's pages; a
    JfireError with the plan's figures when one full context does not fit), else as given
    (1 GiB where --kv-cache-gb was left out). `vision`: whether the engine loads the model's vision
    tower (a decode group does not)."""
    platform = devices[0].platform
    if not size.auto(platform):
        return config
    from jfire import plan
    from jfire.checkpoint.load import kv_dtype_of, resolve_model_path

    if size.device_memory_gib is not None:
        gib, source = size.device_memory_gib, "--device-memory-gib"
    else:
        gib, source = device_memory(list(devices)[: spec.size])
    p = plan.plan(
        str(resolve_model_path(model)[0]),
        spec,
        dtype=dtype,
        kv_dtype=kv_dtype_of(dtype, mesh_size=spec.size, platform=platform),
        limits=plan.Limits(
            max_batch=config.max_batch, prefill_budget=config.prefill_budget, max_context=config.max_model_len
        ),
        compile=False,
        device_memory_gib=gib,
        device_memory_source=source,
        devices=devices,
        vision=vision,
    )
    if not p["fits"]:
        raise JfireError(f"--kv-cache-gb auto: {plan.format_refusal(p)}")
    print(f"jfire: --kv-cache-gb auto: {plan.format_pool(p)}", file=sys.stderr, flush=True)
    return dataclasses.replace(config, num_pages=None, kv_cache_bytes=p["kv_cache_bytes_per_device"])
