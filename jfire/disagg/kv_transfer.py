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

A deployment may code the pages on the wire (`[transfer] compress`, jfire.disagg.kv_codec):
each array then travels as uint8 rows of coded tiles, with the same leading axes (so it splits
over heads the same way). The sender's gather program makes both forms and sends the raw one
when some tile cannot be coded; the transfer says which (`codec`), and the receiver decodes in
its insert program. Both sides' page sums are of the raw values, so the checksum also proves
the coding lossless.

Between groups the page sums are keyed with the deployment secret (`keyed` programs, a
jfire.disagg.transfer_auth.TransferKey per transfer): the checksum then also refuses pages
that nobody holding the secret sent. A host tier's programs, within one process, keep the
plain sums.

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
from jfire.disagg import kv_codec
from jfire.disagg.transfer_auth import TransferKey, keyed_page_sums
from jfire.models.family import CacheSpec, Family
from jfire.programs import powers

HEADS = "kv_heads"  # the cache axis tensor parallelism splits (and may repeat)
CODEC = "exponents"  # a transfer's `codec` when its pages travel coded (jfire.disagg.kv_codec)


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

    def wire_shape(self, c: CacheSpec, coded: bool = False) -> tuple[int, ...]:
        """One page of one cache array as it travels (the checkpoint's own heads); coded: its
        rows of coded tiles."""
        shape = list(c.page_shape(self.page_size))
        if HEADS in c.page_axes():
            shape[c.page_axes().index(HEADS)] //= self.replication
        return kv_codec.coded_shape(tuple(shape), self.dtype) if coded else tuple(shape)

    def wire_dtype(self, coded: bool = False):
        return jnp.uint8 if coded else self.dtype

    @property
    def codable(self) -> bool:
        """Whether this cache's pages can travel coded (bfloat16 or float32 values)."""
        return kv_codec.supported(self.dtype)

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

    def page_sharding(self, c: CacheSpec, coded: bool = False):
        """One page of one array in this side's cache layout (as the cache, less the pages axis)."""
        if self.mesh is None:
            return SingleDeviceSharding(self.devices()[0])
        shape = self.wire_shape(c, coded)
        return NamedSharding(self.mesh, sharding.partition_spec(c.page_axes(), self.mesh, shape))

    def page_structs(self, coded: bool = False) -> list[jax.ShapeDtypeStruct]:
        """One page of each cache array in this side's cache layout."""
        return [
            jax.ShapeDtypeStruct(
                self.wire_shape(c, coded), self.wire_dtype(coded), sharding=self.page_sharding(c, coded)
            )
            for c in self.arrays
        ]

    def wire_structs(self, num_pages: int, shards: int, coded: bool = False) -> list[jax.ShapeDtypeStruct]:
        """What travels for num_pages pages: page-major, one struct per cache array."""
        one = [
            jax.ShapeDtypeStruct(
                self.wire_shape(c, coded), self.wire_dtype(coded), sharding=self.wire_sharding(c, shards)
            )
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


def _page_major(stacked: list, arrays: tuple[CacheSpec, ...], num_pages: int) -> tuple:
    """Each cache array's pages (stacked along its pages axis) as one array per page, page-major."""
    taken = [
        [jax.lax.index_in_dim(x, i, c.pages_axis, keepdims=False) for i in range(num_pages)]
        for x, c in zip(stacked, arrays)
    ]
    return tuple(taken[a][i] for i in range(num_pages) for a in range(len(arrays)))


def _sums(stacked: list, arrays: tuple[CacheSpec, ...], key):
    """The page sums: plain ([w]) without a key, keyed ([w, TAG_LANES]) with one."""
    axes = [c.pages_axis for c in arrays]
    return _page_sums(stacked, axes) if key is None else keyed_page_sums(stacked, axes, key)


def gather_pages(pages, page_ids, key=None, *, arrays: tuple[CacheSpec, ...], replication: int, coded: bool = False):
    """page_ids [w] -> w * len(arrays) wire arrays, page-major, and the [w] page sums (keyed
    under `key`, a TransferKey's device words, if given). coded: also the same pages coded
    (w * len(arrays) more, before the sums), and after the sums whether some tile could not be
    coded."""
    stacked = [jnp.take(_heads_every(pages[c.name], c, replication), page_ids, axis=c.pages_axis) for c in arrays]
    wire = _page_major(stacked, arrays, page_ids.shape[0])
    sums = _sums(stacked, arrays, key)
    if not coded:
        return wire + (sums,)
    encoded = [kv_codec.encode(x) for x in stacked]
    overflow = jnp.any(jnp.stack([over for _, over in encoded]))
    return wire + _page_major([x for x, _ in encoded], arrays, page_ids.shape[0]) + (sums, overflow)


def insert_pages(
    pages, wire, page_ids, key=None, *, arrays: tuple[CacheSpec, ...], replication: int, tiles: tuple | None = None
):
    """Writes wire arrays (page-major) into the pages named by page_ids; an id past the pool
    is dropped (padding up to the compiled width). Also returns the [w] page sums of what
    arrived (padding pages are zeros: they sum to 0), keyed under `key` if given. tiles: the
    arrays arrive coded, in tiles of these shapes (one per cache array)."""
    out = dict(pages)
    n = len(arrays)
    arrived = [jnp.stack(wire[a::n], axis=c.pages_axis) for a, c in enumerate(arrays)]
    if tiles is not None:
        arrived = [kv_codec.decode(x, tile, pages[c.name].dtype) for x, tile, c in zip(arrived, tiles, arrays)]
    for c, stacked in zip(arrays, arrived):
        if replication > 1 and HEADS in c.axes:
            stacked = jnp.repeat(stacked, replication, axis=c.axes.index(HEADS))
        index = (slice(None),) * c.pages_axis + (page_ids,)
        out[c.name] = pages[c.name].at[index].set(stacked, mode="drop")
    return out, _sums(arrived, arrays, key)


def transfer_widths(pages_per_row: int, page_size: int) -> tuple[int, ...]:
    """The page counts transfer programs are compiled for: powers of 4 from 256 positions' worth
    up to a whole context (a request's pages are padded to the next)."""
    return tuple(powers(max(1, 256 // page_size), pages_per_row, 4))


class TransferPrograms:
    """gather (prefill side) or insert (decode side), compiled for each of `widths` pages.
    coded: the gather programs also code the pages; the insert side compiles a second program
    per width that decodes them (raw transfers still arrive: a tile that cannot be coded).
    keyed: the page sums are keyed, each call taking its transfer's TransferKey (between groups)."""

    def __init__(
        self, layout: KVLayout, pages, widths: tuple[int, ...], kind: str, coded: bool = False, keyed: bool = False
    ):
        self.layout, self.kind, self.widths, self.coded, self.keyed = layout, kind, widths, coded, keyed
        self._pages = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), pages)
        self._num_pages = next(iter(pages.values())).shape[layout.arrays[0].pages_axis]
        self._compiled: dict[tuple[int, bool], jax.stages.Compiled] = {}
        ids = layout.mesh and NamedSharding(layout.mesh, PartitionSpec())
        self._ids_sharding = ids or SingleDeviceSharding(layout.devices()[0])
        self.padding: dict[bool, list] = {}  # insert side: zero pages standing in for unused slots (once compiled)

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def _variants(self) -> tuple[bool, ...]:
        """The programs per width: coded or not (a gather program makes both forms at once)."""
        return (False, True) if self.coded and self.kind == "insert" else (self.coded,)

    def compile_all(self, progress=None) -> None:
        """Compiles (or loads) the program of every width; progress(done) after each."""
        for w in self.widths:
            for coded in self._variants():
                self._compiled[w, coded] = compile_cache.compiled(self._lower(w, coded), self.layout.devices())
                if progress:
                    progress(len(self._compiled))
        if self.kind == "insert":
            self.padding = {
                coded: [jax.device_put(np.zeros(s.shape, s.dtype), s.sharding) for s in self.layout.page_structs(coded)]
                for coded in self._variants()
            }

    def _lower(self, w: int, coded: bool):
        ids = jax.ShapeDtypeStruct((w,), jnp.int32, sharding=self._ids_sharding)
        static = dict(arrays=self.layout.arrays, replication=self.layout.replication)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self._ids_sharding) if self.keyed else None
        if self.kind == "gather":
            raw = [s.sharding for s in self.layout.page_structs()] * w
            out = tuple(raw) + ((tuple(s.sharding for s in self.layout.page_structs(True)) * w) if coded else ())
            out += (self._ids_sharding,) * (2 if coded else 1)
            fn = jax.jit(gather_pages, static_argnames=("arrays", "replication", "coded"), out_shardings=out)
            return fn.lower(self._pages, ids, key, coded=coded, **static)
        tiles = tuple(self.layout.wire_shape(c)[-2:] for c in self.layout.arrays) if coded else None
        fn = jax.jit(insert_pages, static_argnames=("arrays", "replication", "tiles"), donate_argnames=("pages",))
        return fn.lower(self._pages, tuple(self.layout.page_structs(coded)) * w, ids, key, tiles=tiles, **static)

    def width_for(self, n: int) -> int:
        return next(w for w in self.widths if w >= n)

    def _ids(self, page_ids: list[int], fill: int) -> jax.Array:
        ids = np.full(self.width_for(len(page_ids)), fill, np.int32)
        ids[: len(page_ids)] = page_ids
        return jax.device_put(ids, self._ids_sharding)

    def _key(self, key: TransferKey | None):
        """The key's words on the device, for a keyed program (None for a plain one)."""
        if self.keyed != (key is not None):
            raise ValueError(
                f"the {'keyed' if self.keyed else 'plain'} {self.kind} programs were called with"
                f"{'out' if key is None else ''} a transfer key"
            )
        return None if key is None else jax.device_put(key.device_words(), self._ids_sharding)

    def _checksum(self, sums, num_pages: int, key: TransferKey | None) -> int:
        """The transfer's checksum from its [width] page sums: plain, or the keyed tag."""
        if key is None:
            return checksum(sums, num_pages)
        return key.tag(sharding.to_host(sums)[:num_pages])

    def gather(self, pages, page_ids: list[int], key: TransferKey | None = None) -> tuple[list[jax.Array], int]:
        """The pages' wire arrays, and their checksum (keyed programs: the tag under `key`)."""
        wire, _, sums, _ = self._gather(pages, page_ids, key)
        return wire, self._checksum(sums, len(page_ids), key)

    def _gather(
        self, pages, page_ids: list[int], key: TransferKey | None = None
    ) -> tuple[list, list, jax.Array, jax.Array | None]:
        """Dispatches the width's gather program: (raw wire arrays, coded ones (empty unless
        coded), [width] page sums, whether some tile could not be coded (None unless coded))."""
        w = self.width_for(len(page_ids))
        out = self._compiled[w, self.coded](pages, self._ids(page_ids, 0), self._key(key))
        n, padded = len(page_ids) * len(self.layout.arrays), w * len(self.layout.arrays)
        if not self.coded:
            return list(out[:n]), [], out[-1], None
        return list(out[:n]), list(out[padded : padded + n]), out[-2], out[-1]

    def gather_dispatched(self, pages, page_ids: list[int]) -> tuple[list[jax.Array], jax.Array]:
        """The pages' wire arrays (page-major) and [width] page sums, still on the device: the
        call is only dispatched, so nothing waits for it here."""
        wire, _, sums, _ = self._gather(pages, page_ids)
        return wire, sums

    def gather_coded(
        self, pages, page_ids: list[int], key: TransferKey | None = None
    ) -> tuple[list[jax.Array], bool, int]:
        """(the pages' wire arrays, coded unless some tile could not be, whether they are; their
        checksum, of the raw values either way)."""
        raw, coded_wire, sums, overflow = self._gather(pages, page_ids, key)
        coded = not bool(overflow)
        return (coded_wire if coded else raw), coded, self._checksum(sums, len(page_ids), key)

    def insert(
        self, pages, arrays: list[jax.Array], page_ids: list[int], coded: bool = False, key: TransferKey | None = None
    ):
        """(the pages with these written in, the checksum of what arrived: keyed programs, the
        tag under `key`)."""
        pages, sums = self.insert_with_sums(pages, arrays, page_ids, coded, key)
        if key is not None:
            return pages, key.tag(sums)
        return pages, int(sums.astype(np.uint64).sum() % (1 << 32))

    def insert_with_sums(
        self,
        pages,
        arrays: list[jax.Array] | list[np.ndarray],
        page_ids: list[int],
        coded: bool = False,
        key: TransferKey | None = None,
    ):
        """(the pages with these written in, each written page's sum of what arrived)."""
        w, n = self.width_for(len(page_ids)), len(self.layout.arrays)
        structs = self.layout.page_structs(coded)
        arrays = [jax.device_put(a, structs[i % n].sharding) for i, a in enumerate(arrays)]
        arrays += self.padding[coded] * (w - len(page_ids))
        program = self._compiled[w, coded]
        pages, sums = program(pages, tuple(arrays), self._ids(page_ids, self._num_pages), self._key(key))
        return pages, sharding.to_host(sums)[: len(page_ids)]


def kv_layout(engine) -> KVLayout:
    """The layout of an engine's cache pages on the wire."""
    model = engine.model
    return KVLayout(model.config, model.kv_replication, engine.config.page_size, model.kv_dtype, model.mesh)


def transfer_programs(
    engine, layout: KVLayout, kind: str, coded: bool = False, keyed: bool = False
) -> TransferPrograms:
    """An engine's gather or insert programs, for every transfer width its rows can need
    (coded: for pages that travel coded too; keyed: with keyed page sums, between groups)."""
    widths = transfer_widths(engine.runner.buckets.pages_per_row, engine.config.page_size)
    return TransferPrograms(layout, engine.runner.pages, widths, kind, coded, keyed)


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


def placeholder(layout: KVLayout, num_pages: int, shards: int, coded: bool = False) -> list[jax.Array]:
    """Zeros in the wire layout of a transfer: published under an id a decode group gave up
    on, so its blocked pull returns (and is thrown away)."""
    structs = layout.wire_structs(num_pages, shards, coded)
    return [jax.device_put(np.zeros(s.shape, s.dtype), s.sharding) for s in structs]
