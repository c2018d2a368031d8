"""Moving one request's KV cache from a prefill group's pages into a decode group's pages.

The wire format is one array per page, `[2 (k, v), layers, kv_heads, page_size, head_dim]`,
with the checkpoint's own KV heads (copies made so tensor parallelism can split them are
dropped before sending and made again on arrival). Sending exactly the request's pages makes
the bytes moved equal its cache size, and one fixed shape per page keeps every program
compiled ahead of time.

On the wire the arrays are split over KV heads into `shards` pieces, on the first `shards`
devices of each side, so JAX's transfer server moves them shard for shard. Each side reshards
between that layout and its own cache layout on its own devices: the two groups may use
different meshes.

The prefill side publishes with `await_pull` and holds the pages until the decode side
acknowledges (through the cluster store) or its own timeout passes; the transfer server's
built-in timeout is not relied on.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jfire import sharding
from jfire.models.llama import LlamaConfig


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What one side knows about its cache: enough to build the wire and cache shardings."""

    cfg: LlamaConfig  # the engine's config (KV heads possibly repeated for tp)
    replication: int  # how many times each checkpoint KV head is repeated in the cache
    page_size: int
    dtype: object
    mesh: Mesh | None  # None: one device

    @property
    def kv_heads(self) -> int:
        """The checkpoint's KV heads: what travels."""
        return self.cfg.num_kv_heads // self.replication

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (2, self.cfg.num_layers, self.kv_heads, self.page_size, self.cfg.head_dim)

    @property
    def page_nbytes(self) -> int:
        return int(np.prod(self.page_shape)) * np.dtype(self.dtype).itemsize

    def devices(self) -> list:
        return list(self.mesh.devices.flat) if self.mesh is not None else [jax.local_devices()[0]]

    def preferred_shards(self) -> int:
        """How many KV-head pieces this side's cache is split into (the decode side asks for this)."""
        if self.mesh is None:
            return 1
        tp = self.mesh.shape["tp"]
        return tp if tp > 1 and self.kv_heads % tp == 0 else 1

    def wire_sharding(self, shards: int):
        """The transfer layout: KV heads in `shards` pieces, on this side's tp devices in order."""
        if shards == 1:
            return SingleDeviceSharding(self.devices()[0])
        # The devices of one tensor-parallel group (dp = pp = ep = 0), in tp order.
        tp_devices = self.mesh.devices[0, 0, :, 0] if self.mesh.shape["tp"] >= shards else self.devices()
        return NamedSharding(Mesh(np.array(list(tp_devices)[:shards]), ("kv",)), PartitionSpec(None, None, "kv"))

    def page_sharding(self):
        """One page in this side's cache layout (layers over pp, KV heads over tp where they divide)."""
        if self.mesh is None:
            return SingleDeviceSharding(self.devices()[0])
        spec = sharding.partition_spec(("layers", "kv_heads", "page_slots", "head_dim"), self.mesh, self.page_shape[1:])
        return NamedSharding(self.mesh, PartitionSpec(None, *spec))

    def wire_structs(self, num_pages: int, shards: int) -> list[jax.ShapeDtypeStruct]:
        s = jax.ShapeDtypeStruct(self.page_shape, self.dtype, sharding=self.wire_sharding(shards))
        return [s] * num_pages

    def usable_shards(self, wanted: int) -> int:
        """`wanted` if this side has that many devices and the heads split that way, else 1."""
        return wanted if wanted > 1 and len(self.devices()) >= wanted and self.kv_heads % wanted == 0 else 1


def new_uuid() -> int:
    return secrets.randbits(62)


# -- the programs: pages -> wire arrays, wire arrays -> pages --------------------------------


def gather_pages(pages, page_ids, *, replication: int):
    """page_ids [w] -> w arrays [2, layers, kv_heads, page_size, head_dim] (checkpoint heads)."""
    k = pages["k"][:, ::replication][:, :, page_ids]
    v = pages["v"][:, ::replication][:, :, page_ids]
    both = jnp.stack([k, v])  # [2, layers, heads, w, page_size, head_dim]
    return tuple(both[:, :, :, i] for i in range(page_ids.shape[0]))


def insert_pages(pages, arrays, page_ids, *, replication: int):
    """Writes wire arrays into the pages named by page_ids; an id past the pool is dropped
    (padding up to the compiled width)."""
    stacked = jnp.stack(arrays, axis=3)  # [2, layers, heads, w, page_size, head_dim]
    if replication > 1:
        stacked = jnp.repeat(stacked, replication, axis=2)
    return {"k": pages["k"].at[:, :, page_ids].set(stacked[0], mode="drop"),
            "v": pages["v"].at[:, :, page_ids].set(stacked[1], mode="drop")}


class TransferPrograms:
    """gather (prefill side) or insert (decode side), compiled for each page-table width."""

    def __init__(self, layout: KVLayout, pages, widths: tuple[int, ...], kind: str):
        self.layout, self.kind, self.widths = layout, kind, widths
        self._pages = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), pages)
        self._compiled: dict[int, object] = {}
        ids = layout.mesh and NamedSharding(layout.mesh, PartitionSpec())
        self._ids_sharding = ids or SingleDeviceSharding(layout.devices()[0])
        self.padding = None  # decode side: a zero page standing in for unused slots

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def compile_all(self) -> None:
        for w in self.widths:
            self._compiled[w] = self._lower(w).compile()
        if self.kind == "insert":
            self.padding = jax.device_put(np.zeros(self.layout.page_shape, self.layout.dtype),
                                          self.layout.page_sharding())

    def _lower(self, w: int):
        ids = jax.ShapeDtypeStruct((w,), jnp.int32, sharding=self._ids_sharding)
        if self.kind == "gather":
            out = tuple([self.layout.page_sharding()] * w)
            return jax.jit(gather_pages, static_argnames=("replication",), out_shardings=out).lower(
                self._pages, ids, replication=self.layout.replication)
        page = jax.ShapeDtypeStruct(self.layout.page_shape, self.layout.dtype, sharding=self.layout.page_sharding())
        return jax.jit(insert_pages, static_argnames=("replication",), donate_argnames=("pages",)).lower(
            self._pages, tuple([page] * w), ids, replication=self.layout.replication)

    def width_for(self, n: int) -> int:
        return next(w for w in self.widths if w >= n)

    def gather(self, pages, page_ids: list[int]) -> list[jax.Array]:
        w = self.width_for(len(page_ids))
        ids = np.zeros(w, np.int32)
        ids[: len(page_ids)] = page_ids
        return list(self._compiled[w](pages, jax.device_put(ids, self._ids_sharding))[: len(page_ids)])

    def insert(self, pages, arrays: list[jax.Array], page_ids: list[int]):
        w = self.width_for(len(page_ids))
        ids = np.full(w, pages["k"].shape[2], np.int32)  # past the pool: dropped
        ids[: len(page_ids)] = page_ids
        arrays = [jax.device_put(a, self.layout.page_sharding()) for a in arrays]
        arrays += [self.padding] * (w - len(arrays))
        return self._compiled[w](pages, tuple(arrays), jax.device_put(ids, self._ids_sharding))


# -- the decode side's pull, with its own deadline -------------------------------------------


class Pull:
    """One pull running on its own thread. A pull whose sender never publishes blocks for
    ever inside the transfer server, so the caller polls `done` against its own deadline and
    abandons the thread when it passes."""

    def __init__(self, server, address: str, uuid: int, structs: list, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.arrays: list | None = None
        self.error: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(server, address, uuid, structs),
                                        name=f"jfire-pull-{uuid}", daemon=True)
        self._thread.start()

    def _run(self, server, address, uuid, structs) -> None:
        try:
            arrays = server.connect(address).pull(uuid, structs)
            jax.block_until_ready(arrays)
            self.arrays = arrays
        except Exception as e:  # noqa: BLE001 - the transfer server raises runtime errors
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def expired(self) -> bool:
        return not self.done and time.monotonic() > self.deadline


def drain(server, uuid: int, structs: list) -> None:
    """Pulls an expired, never-pulled transfer from ourselves, so the transfer server drops
    its reference to the arrays too (in the background: it must never block the caller)."""
    threading.Thread(target=lambda: server.connect(server.address()).pull(uuid, structs),
                     name=f"jfire-drain-{uuid}", daemon=True).start()
