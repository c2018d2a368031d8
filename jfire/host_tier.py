"""A host-memory tier under the device prefix cache, as a KV connector.

The device pool keeps a freed page's block findable until the page is handed out again; then
the block is gone, and a prompt that shared it computes it again. With a host tier, the pool
tells the connector which cached blocks an allocation is about to reuse
(`BlockPool.on_evict`), and the connector dispatches a gather of those pages before any
program can overwrite them (the device runs calls in order, so the step that reuses the pages
runs after it). The gathered pages reach host memory at the next loop turn, off the step's
critical path, keyed by the same chained block hashes (jfire.kv_cache.block_hashes) in an LRU
cache of bounded size.

Reuse gating (`min_uses`): only a block that served at least that many prompts on the device
(the one that computed it and those that found it there) is kept, so prompts nobody repeats do
not push out of host memory the prefixes that are repeated; 1 keeps every evicted block.

When the scheduler admits a prompt whose leading blocks the device lacks, it asks the
connector (`load_prefix`): the blocks found in host memory are written into fresh pages by
the insert program, registered in the pool like any computed block, and the prompt's prefill
continues after them. Each block carries the sum of its bits as the device computed it when
it was saved; the insert computes the same sum of what it wrote, and a block that differs (a
corrupt or stale entry) is dropped and computed again, never served.

Blocks are keyed by the model's identity as well as their hash (`model_identity`: the config,
the page layout and a digest of the weights), so a store that outlives one engine or is shared
by several (a restart, a disk tier, another group's blocks) never hands one model's KV to
another: equal token ids of another model miss. A block whose arrays are not this engine's
page layout is dropped before it is written in.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jfire import faults
from jfire.disagg.kv_transfer import kv_layout, transfer_programs
from jfire.kv_connector import KVConnector, Progress
from jfire.sharding import to_host


@dataclasses.dataclass
class HostBlock:
    arrays: list[np.ndarray]  # the page's wire arrays, one per cache array
    page_sum: int  # the wrapping sum of their bits, as the device computed it when saving them

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class HostPrefixCache:
    """Blocks by chained hash; the least recently used go first past `capacity_bytes`."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._blocks: collections.OrderedDict[bytes, HostBlock] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def get(self, block_hash: bytes) -> HostBlock | None:
        block = self._blocks.get(block_hash)
        if block is not None:
            self._blocks.move_to_end(block_hash)
        return block

    def put(self, block_hash: bytes, block: HostBlock) -> None:
        if block.nbytes > self.capacity_bytes:
            return
        self.drop(block_hash)
        self._blocks[block_hash] = block
        self.nbytes += block.nbytes
        while self.nbytes > self.capacity_bytes:
            _, oldest = self._blocks.popitem(last=False)
            self.nbytes -= oldest.nbytes

    def drop(self, block_hash: bytes) -> None:
        block = self._blocks.pop(block_hash, None)
        if block is not None:
            self.nbytes -= block.nbytes


class ModelBlocks:
    """One model's blocks in a HostPrefixCache that may hold other models' too: each is stored
    under the model's identity followed by its chained hash."""

    def __init__(self, store: HostPrefixCache, identity: bytes):
        self.store, self.identity = store, identity

    def __len__(self) -> int:
        return len(self.store)

    def __contains__(self, block_hash: bytes) -> bool:
        return self.identity + block_hash in self.store

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def get(self, block_hash: bytes) -> HostBlock | None:
        return self.store.get(self.identity + block_hash)

    def put(self, block_hash: bytes, block: HostBlock) -> None:
        self.store.put(self.identity + block_hash, block)

    def drop(self, block_hash: bytes) -> None:
        self.store.drop(self.identity + block_hash)


def _bit_sum(x):
    """The wrapping sum of an array's bits as uint32 (of its values, for integers)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = jax.lax.bitcast_convert_type(x, {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[jnp.dtype(x.dtype).itemsize])
    return jnp.sum(x.astype(jnp.uint32), dtype=jnp.uint32)


_weight_sums = jax.jit(lambda leaves: jnp.stack([_bit_sum(x) for x in leaves]))


def model_identity(engine) -> bytes:
    """16 bytes naming what a block's KV depends on besides its tokens: the model's config and
    dtype, the page layout on the wire, and its weights (each array's sum of its bits: one pass
    over them on the device, about as long as one decode step reads)."""
    model, layout = engine.model, kv_layout(engine)
    described = {
        "family": type(model.config).__name__,
        "config": model.config.to_dict(),
        "dtype": str(model.dtype),
        "kv_replication": model.kv_replication,
        "page": [(layout.wire_shape(c), str(np.dtype(model.kv_dtype))) for c in layout.arrays],
    }
    h = hashlib.blake2b(json.dumps(described, sort_keys=True, default=str).encode(), digest_size=16)
    leaves = jax.tree.leaves(model.params)
    if leaves:
        h.update(np.asarray(_weight_sums(leaves)).tobytes())
    return h.digest()


class HostTier(KVConnector):
    """The colocated engine's connector with a host-memory tier of `capacity_bytes`, or over
    `store`, a HostPrefixCache that other engines' tiers may use too; an evicted block is kept
    once it has served `min_uses` prompts."""

    pages_by_id = True

    def __init__(self, capacity_bytes: int = 0, *, store: HostPrefixCache | None = None, min_uses: int = 1):
        if min_uses < 1:
            raise ValueError(f"min_uses must be at least 1, got {min_uses}")
        self.min_uses = min_uses
        self.store = store if store is not None else HostPrefixCache(capacity_bytes)
        self.cache = ModelBlocks(self.store, b"")  # under the model's identity once bound
        self._saving: list[tuple[list[bytes], list, object]] = []  # gathered on the device, not yet on the host
        self.counts: collections.Counter = collections.Counter()
        self.load_s = 0.0  # spent loading blocks back

    def bind(self, engine) -> None:
        super().bind(engine)
        layout = kv_layout(engine)
        self.arrays_per_page = len(layout.arrays)
        self.gather = transfer_programs(engine, layout, "gather")
        self.insert = transfer_programs(engine, layout, "insert")
        self.page_arrays = [(layout.wire_shape(c), np.dtype(engine.model.kv_dtype)) for c in layout.arrays]
        self.cache = ModelBlocks(self.store, model_identity(engine))
        engine.pool.on_evict = self._evicted

    def side_programs(self) -> list:
        return [self.gather, self.insert]

    def _evicted(self, evicted: list[tuple[int, bytes, int]]) -> None:
        """Cached blocks about to be reused: the pages of those used often enough are gathered
        now, read later."""
        kept = [(page, h) for page, h, uses in evicted if uses >= self.min_uses]
        self.counts["gated"] += len(evicted) - len(kept)
        widest = self.gather.widths[-1]
        for i in range(0, len(kept), widest):
            part = kept[i : i + widest]
            wire, sums = self.gather.gather_dispatched(self.engine.runner.pages, [page for page, _ in part])
            self._saving.append(([h for _, h in part], wire, sums))
        self.counts["saved"] += len(kept)

    def _settle(self) -> None:
        """Moves the gathered blocks into host memory."""
        saving, self._saving = self._saving, []
        n = self.arrays_per_page
        for hashes, wire, sums in saving:
            page_sums = to_host(sums)
            for i, block_hash in enumerate(hashes):
                block = HostBlock([np.asarray(a) for a in wire[i * n : (i + 1) * n]], int(page_sums[i]))
                if faults.host_block_saved is not None:
                    faults.host_block_saved(block_hash, block)
                self.cache.put(block_hash, block)
                self.counts["bytes_saved"] += block.nbytes

    def update(self) -> Progress:
        self._settle()
        return Progress()

    def load_prefix(self, hashes: list[bytes]) -> list[int]:
        self._settle()
        found = []
        for block_hash in hashes:
            block = self.cache.get(block_hash)
            if block is None:
                break
            if [(a.shape, a.dtype) for a in block.arrays] != self.page_arrays:  # not a page of this layout
                self.cache.drop(block_hash)
                self.counts["corrupt"] += 1
                break
            found.append((block_hash, block))
        if not found:
            return []
        t0 = time.perf_counter()
        pool, runner = self.engine.pool, self.engine.runner
        pages = pool.allocate(len(found))  # what it evicts is gathered before the insert runs
        if pages is None:
            return []
        widest = self.insert.widths[-1]
        arrived: list[int] = []
        for i in range(0, len(found), widest):
            part = found[i : i + widest]
            arrays = [a for _, block in part for a in block.arrays]
            runner.pages, sums = self.insert.insert_with_sums(runner.pages, arrays, pages[i : i + len(part)])
            arrived += [int(s) for s in sums]
        differ = [s != block.page_sum for s, (_, block) in zip(arrived, found)]
        good = differ.index(True) if any(differ) else len(found)
        for (block_hash, _), bad in zip(found, differ):  # not what was saved: dropped, never served
            if bad:
                self.cache.drop(block_hash)
                self.counts["corrupt"] += 1
        for page, (block_hash, _) in zip(pages[:good], found):
            pool.register(page, block_hash)
        pool.free(pages[good:])
        self.counts["loaded"] += good
        self.counts["bytes_loaded"] += sum(block.nbytes for _, block in found[:good])
        self.load_s += time.perf_counter() - t0
        return pages[:good]

    def stats(self) -> dict:
        return {
            "host_blocks": len(self.cache),
            "host_bytes": self.cache.nbytes,
            "host_blocks_saved": self.counts["saved"],
            "host_blocks_loaded": self.counts["loaded"],
            "host_blocks_corrupt": self.counts["corrupt"],
            "host_blocks_gated": self.counts["gated"],
            "host_bytes_saved": self.counts["bytes_saved"],  # device to host
            "host_bytes_loaded": self.counts["bytes_loaded"],  # host to device
            "host_load_s": self.load_s,
        }
