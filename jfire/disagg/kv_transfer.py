"""Moving one request's KV cache from a prefill group's pages into a decode group's pages.

The wire format follows the family's cache declaration: for each page of the request, one
array per declared cache array (`cache_specs()`, e.g. keys then values) with the `pages`
axis dropped, e.g. `[layers, kv_heads, page_size, head_dim]`, page-major. Cache heads that
were repeated so tensor parallelism could split them are dropped before sending and made
again on arrival. Sending exactly the request's pages makes the bytes moved equal its cache
size, and fixed shapes per page keep every program compiled ahead of time.

On the wire an array with a `kv_heads` axis may be split over it into `shards` pieces, on
the first `shards` devices of each side, so JAX's transfer server moves it shard for shard.
Each side reshards between that layout and its own cache layout on its own devices: the two
groups may use different meshes.

The prefill side publishes with `await_pull` and holds the pages until the decode side
acknowledges (through the cluster store) or its own timeout passes; the transfer server's
built-in timeout is not relied on.
"""

from __future__ import annotations

import dataclasses
import datetime
import queue
import secrets
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jfire import compile_cache, sharding
from jfire.models.family import CacheSpec, Family
from jfire.programs import powers

HEADS = "kv_heads"  # the cache axis tensor parallelism splits (and may repeat)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What one side knows about its cache: enough to build the wire and cache shardings."""

    cfg: Family  # the engine's config (cache heads possibly repeated for tp)
    replication: int  # how many times each checkpoint cache head is repeated in the cache
    page_size: int
    dtype: object
    mesh: Mesh | None  # None: one device

    @property
    def arrays(self) -> tuple[CacheSpec, ...]:
        return self.cfg.cache_specs()

    def wire_shape(self, c: CacheSpec) -> tuple[int, ...]:
        """One page of one cache array as it travels (the checkpoint's own heads)."""
        shape = list(c.page_shape(self.page_size))
        if HEADS in c.page_axes():
            shape[c.page_axes().index(HEADS)] //= self.replication
        return tuple(shape)

    @property
    def page_nbytes(self) -> int:
        return sum(int(np.prod(self.wire_shape(c))) for c in self.arrays) * np.dtype(self.dtype).itemsize

    @property
    def wire_heads(self) -> int:
        """Heads every array can be split by on the wire (1: some array has no head axis)."""
        heads = [self.wire_shape(c)[c.page_axes().index(HEADS)] for c in self.arrays if HEADS in c.page_axes()]
        return min(heads) if len(heads) == len(self.arrays) else 1

    def devices(self) -> list:
        return list(self.mesh.devices.flat) if self.mesh is not None else [jax.local_devices()[0]]

    def preferred_shards(self) -> int:
        """How many head pieces this side's cache is split into (the decode side asks for this)."""
        if self.mesh is None:
            return 1
        tp = self.mesh.shape["tp"]
        return tp if tp > 1 and self.wire_heads % tp == 0 else 1

    def wire_sharding(self, c: CacheSpec, shards: int):
        """The transfer layout of one array: heads in `shards` pieces, on this side's tp devices."""
        if shards == 1:
            return SingleDeviceSharding(self.devices()[0])
        # The devices of one tensor-parallel group (dp = pp = ep = 0), in tp order.
        tp_devices = self.mesh.devices[0, 0, :, 0] if self.mesh.shape["tp"] >= shards else self.devices()
        spec = PartitionSpec(*("kv" if a == HEADS else None for a in c.page_axes()))
        return NamedSharding(Mesh(np.array(list(tp_devices)[:shards]), ("kv",)), spec)

    def page_sharding(self, c: CacheSpec):
        """One page of one array in this side's cache layout (as the cache, less the pages axis)."""
        if self.mesh is None:
            return SingleDeviceSharding(self.devices()[0])
        return NamedSharding(self.mesh, sharding.partition_spec(c.page_axes(), self.mesh, self.wire_shape(c)))

    def wire_structs(self, num_pages: int, shards: int) -> list[jax.ShapeDtypeStruct]:
        """What travels for num_pages pages: page-major, one struct per cache array."""
        one = [
            jax.ShapeDtypeStruct(self.wire_shape(c), self.dtype, sharding=self.wire_sharding(c, shards))
            for c in self.arrays
        ]
        return one * num_pages

    def to_wire(self, arrays: list, shards: int) -> list[jax.Array]:
        """Gathered page arrays moved into their wire layout."""
        n = len(self.arrays)
        return [jax.device_put(a, self.wire_sharding(self.arrays[i % n], shards)) for i, a in enumerate(arrays)]

    def usable_shards(self, wanted: int) -> int:
        """`wanted` if this side has that many devices and the heads split that way, else 1."""
        return wanted if wanted > 1 and len(self.devices()) >= wanted and self.wire_heads % wanted == 0 else 1


def new_uuid() -> int:
    return secrets.randbits(62)


# -- the programs: pages -> wire arrays, wire arrays -> pages --------------------------------


def _heads_every(x, c: CacheSpec, replication: int):
    """The checkpoint's own heads of a cache array (every replication-th)."""
    if replication == 1 or HEADS not in c.axes:
        return x
    return jax.lax.slice_in_dim(x, 0, None, replication, axis=c.axes.index(HEADS))


def _bits(x):
    """An array's bit patterns as uint32 (a checksum compares bits, never float values)."""
    unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[jnp.dtype(x.dtype).itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _page_sums(stacked: list, axes: list[int]):
    """[pages] uint32: each page's wrapping sum of the bits of its wire arrays, from each cache
    array's pages stacked along axes[a]. The sender and the receiver each compute it on their
    side; a transfer broken off midway (its sender killed) can otherwise arrive as if complete,
    holding stale bytes. One reduction per cache array, not one per page: a program of a
    whole context's pages then compiles in seconds, not a minute."""

    def per_page(x, axis):
        bits = _bits(x)
        return jnp.sum(bits, axis=tuple(d for d in range(bits.ndim) if d != axis), dtype=jnp.uint32)

    return sum(per_page(x, axis) for x, axis in zip(stacked, axes))


def checksum(page_sums, num_pages: int) -> int:
    """The transfer's checksum: its first num_pages page sums (the rest pad the width), mod 2**32."""
    return int(sharding.to_host(page_sums)[:num_pages].astype(np.uint64).sum() % (1 << 32))


def gather_pages(pages, page_ids, *, arrays: tuple[CacheSpec, ...], replication: int):
    """page_ids [w] -> w * len(arrays) wire arrays, page-major, and the [w] page sums."""
    stacked = [jnp.take(_heads_every(pages[c.name], c, replication), page_ids, axis=c.pages_axis) for c in arrays]
    taken = [
        [jax.lax.index_in_dim(x, i, c.pages_axis, keepdims=False) for i in range(page_ids.shape[0])]
        for x, c in zip(stacked, arrays)
    ]
    wire = tuple(taken[a][i] for i in range(page_ids.shape[0]) for a in range(len(arrays)))
    return wire + (_page_sums(stacked, [c.pages_axis for c in arrays]),)


def insert_pages(pages, wire, page_ids, *, arrays: tuple[CacheSpec, ...], replication: int):
    """Writes wire arrays (page-major) into the pages named by page_ids; an id past the pool
    is dropped (padding up to the compiled width). Also returns the [w] page sums of what
    arrived (padding pages are zeros: they sum to 0)."""
    out = dict(pages)
    n = len(arrays)
    arrived = [jnp.stack(wire[a::n], axis=c.pages_axis) for a, c in enumerate(arrays)]
    for c, stacked in zip(arrays, arrived):
        if replication > 1 and HEADS in c.axes:
            stacked = jnp.repeat(stacked, replication, axis=c.axes.index(HEADS))
        index = (slice(None),) * c.pages_axis + (page_ids,)
        out[c.name] = pages[c.name].at[index].set(stacked, mode="drop")
    return out, _page_sums(arrived, [c.pages_axis for c in arrays])


def transfer_widths(pages_per_row: int, page_size: int) -> tuple[int, ...]:
    """The page counts transfer programs are compiled for: powers of 4 from 256 positions' worth
    up to a whole context (a request's pages are padded to the next)."""
    return tuple(powers(max(1, 256 // page_size), pages_per_row, 4))


class TransferPrograms:
    """gather (prefill side) or insert (decode side), compiled for each of `widths` pages."""

    def __init__(self, layout: KVLayout, pages, widths: tuple[int, ...], kind: str):
        self.layout, self.kind, self.widths = layout, kind, widths
        self._pages = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), pages)
        self._num_pages = next(iter(pages.values())).shape[layout.arrays[0].pages_axis]
        self._compiled: dict[int, object] = {}
        ids = layout.mesh and NamedSharding(layout.mesh, PartitionSpec())
        self._ids_sharding = ids or SingleDeviceSharding(layout.devices()[0])
        self.padding: list = []  # insert side: zero pages standing in for unused slots (once compiled)

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def compile_all(self, progress=None) -> None:
        """Compiles (or loads) the program of every width; progress(done) after each."""
        for w in self.widths:
            self._compiled[w] = compile_cache.compiled(self._lower(w), self.layout.devices())
            if progress:
                progress(len(self._compiled))
        if self.kind == "insert":
            self.padding = [
                jax.device_put(np.zeros(self.layout.wire_shape(c), self.layout.dtype), self.layout.page_sharding(c))
                for c in self.layout.arrays
            ]

    def _page_structs(self, w: int) -> tuple:
        one = [
            jax.ShapeDtypeStruct(self.layout.wire_shape(c), self.layout.dtype, sharding=self.layout.page_sharding(c))
            for c in self.layout.arrays
        ]
        return tuple(one * w)

    def _lower(self, w: int):
        ids = jax.ShapeDtypeStruct((w,), jnp.int32, sharding=self._ids_sharding)
        static = dict(arrays=self.layout.arrays, replication=self.layout.replication)
        if self.kind == "gather":
            out = tuple(s.sharding for s in self._page_structs(w)) + (self._ids_sharding,)
            return jax.jit(gather_pages, static_argnames=("arrays", "replication"), out_shardings=out).lower(
                self._pages, ids, **static
            )
        return jax.jit(insert_pages, static_argnames=("arrays", "replication"), donate_argnames=("pages",)).lower(
            self._pages, self._page_structs(w), ids, **static
        )

    def width_for(self, n: int) -> int:
        return next(w for w in self.widths if w >= n)

    def gather(self, pages, page_ids: list[int]) -> tuple[list[jax.Array], int]:
        """The pages' wire arrays, and their checksum."""
        wire, sums = self.gather_dispatched(pages, page_ids)
        return wire, checksum(sums, len(page_ids))

    def gather_dispatched(self, pages, page_ids: list[int]) -> tuple[list[jax.Array], jax.Array]:
        """The pages' wire arrays (page-major) and [width] page sums, still on the device: the
        call is only dispatched, so nothing waits for it here."""
        w = self.width_for(len(page_ids))
        ids = np.zeros(w, np.int32)
        ids[: len(page_ids)] = page_ids
        *wire, sums = self._compiled[w](pages, jax.device_put(ids, self._ids_sharding))
        return list(wire[: len(page_ids) * len(self.layout.arrays)]), sums

    def insert(self, pages, arrays: list[jax.Array], page_ids: list[int]):
        """(the pages with these written in, the checksum of what arrived)."""
        pages, sums = self.insert_with_sums(pages, arrays, page_ids)
        return pages, int(sums.astype(np.uint64).sum() % (1 << 32))

    def insert_with_sums(self, pages, arrays: list[jax.Array] | list[np.ndarray], page_ids: list[int]):
        """(the pages with these written in, each written page's sum of what arrived)."""
        w = self.width_for(len(page_ids))
        ids = np.full(w, self._num_pages, np.int32)  # past the pool: dropped
        ids[: len(page_ids)] = page_ids
        n = len(self.layout.arrays)
        arrays = [jax.device_put(a, self.layout.page_sharding(self.layout.arrays[i % n])) for i, a in enumerate(arrays)]
        arrays += self.padding * (w - len(page_ids))
        pages, sums = self._compiled[w](pages, tuple(arrays), jax.device_put(ids, self._ids_sharding))
        return pages, sharding.to_host(sums)[: len(page_ids)]


def kv_layout(engine) -> KVLayout:
    """The layout of an engine's cache pages on the wire."""
    model = engine.model
    return KVLayout(model.config, model.kv_replication, engine.config.page_size, model.kv_dtype, model.mesh)


def transfer_programs(engine, layout: KVLayout, kind: str) -> TransferPrograms:
    """An engine's gather or insert programs, for every transfer width its rows can need."""
    widths = transfer_widths(engine.runner.buckets.pages_per_row, engine.config.page_size)
    return TransferPrograms(layout, engine.runner.pages, widths, kind)


# -- pulls: a fixed pool of threads, each pull with its own deadline -------------------------


def fetch(server, address: str, uuid: int, structs: list, timeout=None) -> list[jax.Array]:
    """Pulls one published list of arrays and waits until every byte has arrived.

    The connection is held until then, not just until pull() returns (which is before the
    data arrives): when a receiving connection closes, jaxlib's transfer server (0.10.2) hands
    the sender's staging buffers back for reuse even while zero-copy sends from them are still
    queued on the socket, so another pull's copy overwrites the tail of this one in flight and
    the receiver gets some other transfer's bytes (scripts/repro_transfer_teardown.py shows it
    with jaxlib alone; docs/disaggregation.md has the details)."""
    connection = server.connect(address)
    arrays = connection.pull(uuid, structs, timeout=timeout)  # None: no timeout (pull() takes it so)
    jax.block_until_ready(arrays)
    del connection  # only now may the sender reuse what it staged this pull in
    return arrays


class Pull:
    """One pull, run by a Puller's thread, polled by the engine against its own deadline.
    The transfer server's pull has no deadline of its own that works across processes, so
    each way it could wait for ever is closed separately:
      - the sender is already gone: a pull from an address nobody listens on retries for
        ever, so the thread first probes the address with a plain TCP connect;
      - the sender dies mid-pull: the connection breaks and the pull fails at once;
      - the sender is alive but never publishes this id (it expired it, or never had it):
        past the deadline the decode side leaves word in the cluster store (`abandon`), and
        the sender publishes zeros under that id, which ends the pull."""

    def __init__(self, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.arrays: list | None = None
        self.error: str | None = None
        self._done = threading.Event()

    def run(self, server, address: str, uuid: int, structs: list) -> None:
        try:
            problem = unreachable(address)
            if problem:
                self.error = f"its transfer server at {address} is not answering ({problem}); the process has stopped"
            else:
                self.arrays = fetch(server, address, uuid, structs)
        except Exception as e:  # noqa: BLE001 - the transfer server raises runtime errors
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def expired(self) -> bool:
        return not self.done and time.monotonic() > self.deadline


PULL_WORKERS = 4  # pulls at once per process; more wait their turn (within their deadline)


class Puller:
    """One process's pulls (and drains) on a fixed pool of threads, shared by all its
    transfers: a thread per transfer made the process grow without bound (each new thread
    took memory from another of glibc's per-thread arenas, which it kept). The threads are
    daemons: a pull still blocked when the process exits must not keep it alive."""

    def __init__(self, server, workers: int = PULL_WORKERS):
        self.server, self.workers = server, workers
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        for i in range(workers):
            threading.Thread(target=self._serve, name=f"jfire-pull-{i}", daemon=True).start()

    @property
    def in_flight(self) -> int:
        """Pulls and drains queued or running (each ends by its deadline at the latest)."""
        with self._lock:
            return self._in_flight

    def _serve(self) -> None:
        while (job := self._work.get()) is not None:
            try:
                job()
            finally:
                with self._lock:
                    self._in_flight -= 1

    def _submit(self, job) -> None:
        with self._lock:
            self._in_flight += 1
        self._work.put(job)

    def pull(self, address: str, uuid: int, structs: list, timeout_s: float) -> Pull:
        pull = Pull(timeout_s)
        self._submit(lambda: pull.run(self.server, address, uuid, structs))
        return pull

    def drain(self, uuid: int, structs: list, timeout_s: float) -> None:
        """Pulls an expired or dropped, never-pulled transfer from ourselves, so the transfer
        server drops its reference to the arrays too (bounded: if the decode side took it
        after all, this pull would otherwise wait for ever; a pull from this process's own
        server honours an aware-datetime timeout)."""
        until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=timeout_s)

        def run():
            try:
                fetch(self.server, self.server.address(), uuid, structs, timeout=until)
            except Exception:  # noqa: BLE001 - "Pull expired": someone else took it, which is fine
                pass

        self._submit(run)

    def shutdown(self) -> None:
        """Ends the threads once the work queued before this is done."""
        for _ in range(self.workers):
            self._work.put(None)


def unreachable(address: str, timeout_s: float = 2.0) -> str | None:
    """Why nothing accepts a TCP connection at host:port, or None if something does."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def placeholder(layout: KVLayout, num_pages: int, shards: int) -> list[jax.Array]:
    """Zeros in the wire layout of a transfer: published under an id a decode group gave up
    on, so its blocked pull returns (and is thrown away)."""
    return [jax.device_put(np.zeros(s.shape, s.dtype), s.sharding) for s in layout.wire_structs(num_pages, shards)]
