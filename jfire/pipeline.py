"""Pipeline parallelism: contiguous layer stages over the mesh's `pp` axis.

The batch is split into micro-batches that flow through the stages one tick at a time:
at tick t, stage s works on micro-batch t - s. After pp - 1 ticks of fill every stage is busy
on every tick until the last micro-batch enters the last stage. Activations move to the next
stage with `ppermute` inside `shard_map` (manual over `pp`; `tp` and `dp` stay automatic, so
tensor parallelism inside a stage comes from the sharding rules as without pipelining).

Each stage holds only its layers' weights and KV cache (both sharded over pp on the layer
axis). Ticks where a stage has no micro-batch run with position -1, so they write nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def schedule(num_stages: int, num_microbatches: int) -> list[list[int | None]]:
    """The micro-batch each stage works on at each tick (None = idle): ticks x stages."""
    ticks = num_microbatches + num_stages - 1
    return [[(t - s) if 0 <= t - s < num_microbatches else None for s in range(num_stages)] for t in range(ticks)]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A pipelined layer stack for a family's `decoder(..., layer_stack=...)`; hashable, so
    programs can take it as a static argument. It knows nothing of the model: it is handed
    the segment's layer loop `run` and its stacked weights."""

    mesh: jax.sharding.Mesh
    microbatches: int

    @property
    def stages(self) -> int:
        return self.mesh.shape["pp"]

    def __call__(self, run, layers, x, positions, pages, page_table):
        rows = x.shape[0]
        m = max(1, min(self.microbatches, rows))
        while rows % m:  # micro-batches must split the rows evenly
            m -= 1

        def split(a):
            return a.reshape(m, rows // m, *a.shape[1:])

        stage_fn = functools.partial(_stages, run=run, num_stages=self.stages)
        run = jax.shard_map(
            stage_fn,
            mesh=self.mesh,
            axis_names=frozenset({"pp"}),
            check_vma=False,
            in_specs=(P("pp"), P(), P(), P(), P("pp")),
            out_specs=(P(), P("pp")),
        )
        out, pages = run(layers, split(x), split(positions), split(page_table), pages)
        return out.reshape(rows, *out.shape[2:]), pages


def _stages(layers, xs, positions, tables, pages, *, run, num_stages):
    """One stage's view: its layers and cache; xs/positions/tables hold every micro-batch."""
    stage = jax.lax.axis_index("pp")
    m = xs.shape[0]
    # The stage's first layer in the model (for per-layer data); in its cache slice, layer 0.
    # A periodic segment's params lead with periods, its cache with layers: a stage holds whole
    # periods (`Family.mesh_problems` refuses other splits), so both slices start at this layer.
    first_layer = run.segment.first + stage * (run.segment.count // num_stages)
    forward = [(i, (i + 1) % num_stages) for i in range(num_stages)]

    def tick(carry, t):
        received, pages, outs = carry
        mb = t - stage
        active = (mb >= 0) & (mb < m)
        mb = jnp.clip(mb, 0, m - 1)
        x = jnp.where(stage == 0, xs[mb], received)
        pos = jnp.where(active, positions[mb], -1)
        y, pages = run(layers, x, pos, pages, tables[mb], first_layer, 0)
        keep = active & (stage == num_stages - 1)
        outs = outs.at[mb].set(jnp.where(keep, y, outs[mb]))
        return (jax.lax.ppermute(y, "pp", forward), pages, outs), None

    init = (jnp.zeros_like(xs[0]), pages, jnp.zeros_like(xs))
    (_, pages, outs), _ = jax.lax.scan(tick, init, jnp.arange(m + num_stages - 1))
    # Only the last stage filled `outs`; the sum hands its result to every stage.
    return jax.lax.psum(outs, "pp"), pages
