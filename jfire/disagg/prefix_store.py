"""One prefix store over a deployment's prefill groups: a group takes the prompt blocks another
group computed instead of computing them again, so a session is not recomputed because it moved.

Each prefill group with a host tier (`jfire launch --host-kv-gb`) serves its blocks to the
others and takes theirs in:
- Serving (`SharedPrefixes.export`, behind the group's `POST /kv/blocks`): the blocks of the
  given chained hashes, in order, up to the first it holds nowhere: from its device cache
  (gathered by the host tier's gather program, on the engine thread, before any step can reuse
  the pages) or from its host tier. They travel as safetensors: each page's wire arrays, its
  hash and the sum of its bits as the holder computed it.
- Taking in: when the frontend sends a request to a group while another holds more of its
  prefix (jfire.disagg.frontend: routing weighs the blocks to compute against the queues, so
  this happens when the holder is busy), the request names that group (`prefix_from`). Before
  the prompt is submitted, the group fetches the blocks its own caches lack and puts them in
  its host tier (`receive`); admission then loads them like any host-tier block, and the insert
  checks each block's sum: a block that arrived damaged is computed again, never served.
A holder that is down, slow or restarted costs only the fetch's time limit and the recompute.

The taker asks only a prefill group of its deployment, at the control address that group
registered in the (signed) store, with the deployment's control token; the holder signs its
answer with the deployment secret over what was asked and what it sends (`blocks_tag`), and
the taker keeps only the blocks it asked for, in order (`asked_for`): a block under a hash
nobody asked for never reaches its host tier.

Groups of different KV layouts (meshes that split the cache differently) never share blocks:
the frontend names a holder only of the same layout, and a holder lends blocks only to a group
whose model identity (config, page layout, weights: jfire.host_tier.model_identity) is its own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
from collections.abc import Sequence

import httpx
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from jfire.deployment_secret import DeploymentSecret
from jfire.host_tier import HostBlock, HostTier
from jfire.kv_connector import KVConnector, Progress

FETCH_TIMEOUT_S = 10.0  # a holder that takes longer is skipped: the prompt is computed instead
TAG_HEADER = "x-jfire-blocks-tag"  # the holder's signature of its answer (blocks_tag)
TAG_PURPOSE = "kv-blocks"


@dataclasses.dataclass
class Exported:
    """Blocks gathered for another group: host blocks as they are, device pages still being
    gathered (`to_host` waits for them, off the engine thread)."""

    hashes: list[bytes]
    host: dict[int, HostBlock]  # position in `hashes` -> block from the host tier
    device: list[tuple[list[int], Sequence, object]]  # (positions, wire arrays, page sums), dispatched
    arrays_per_page: int

    def to_host(self) -> list[tuple[bytes, HostBlock]]:
        blocks = dict(self.host)
        n = self.arrays_per_page
        for positions, wire, sums in self.device:
            page_sums = np.asarray(sums)
            for k, position in enumerate(positions):
                arrays = [np.asarray(a) for a in wire[k * n : (k + 1) * n]]
                blocks[position] = HostBlock(arrays, int(page_sums[k]))
        return [(self.hashes[i], blocks[i]) for i in range(len(self.hashes))]


class SharedPrefixes(KVConnector):
    """The tier beside a prefill group's host tier that lends its blocks to the deployment's
    other prefill groups and takes theirs in. `export` and `receive` are called from the
    group's HTTP handlers; the device and the host tier are touched only on the engine thread,
    in `update`."""

    pages_by_id = True

    def __init__(self, host: HostTier):
        self.host = host
        self._exports: queue.SimpleQueue = queue.SimpleQueue()
        self._arrivals: queue.SimpleQueue = queue.SimpleQueue()
        self.counts: dict[str, int] = {"exported": 0, "received": 0}

    def bind(self, engine) -> None:
        super().bind(engine)
        self.pool = engine.pool

    @property
    def identity(self) -> bytes:
        """The model's identity the host tier files blocks under (jfire.host_tier.model_identity):
        groups lend each other blocks only when theirs are equal."""
        return self.host.cache.identity

    # -- any thread --------------------------------------------------------------------------

    def export(self, hashes: list[bytes]) -> concurrent.futures.Future:
        """A future of the `Exported` blocks of the longest leading run of `hashes` held here."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._exports.put((hashes, future))
        self.engine.wake()
        return future

    def receive(self, blocks: list[tuple[bytes, HostBlock]]) -> None:
        """Blocks another group computed, for the host tier (taken in at the next loop turn)."""
        self._arrivals.put(blocks)

    # -- the engine thread -------------------------------------------------------------------

    def has_pending(self) -> bool:
        return not self._exports.empty()

    def update(self) -> Progress:
        while not self._arrivals.empty():
            for block_hash, block in self._arrivals.get():
                if block_hash not in self.host.cache:
                    self.host.cache.put(block_hash, block)
                    self.counts["received"] += 1
        while not self._exports.empty():
            hashes, future = self._exports.get()
            if future.set_running_or_notify_cancel():
                future.set_result(self._gather(hashes))
        return Progress()

    def _gather(self, hashes: list[bytes]) -> Exported:
        host: dict[int, HostBlock] = {}
        on_device: list[tuple[int, int]] = []  # (position, page)
        for i, block_hash in enumerate(hashes):
            page = self.pool.page_of(block_hash)
            if page is not None:
                on_device.append((i, page))
            elif (block := self.host.cache.get(block_hash)) is not None:
                host[i] = block
            else:
                hashes = hashes[:i]
                break
        gather = self.host.gather
        widest = gather.widths[-1]
        device: list[tuple[list[int], Sequence, object]] = []
        for start in range(0, len(on_device), widest):
            part = on_device[start : start + widest]
            wire, sums = gather.gather_dispatched(self.engine.runner.pages, [page for _, page in part])
            device.append(([position for position, _ in part], wire, sums))
        self.counts["exported"] += len(hashes)
        return Exported(hashes, host, device, self.host.arrays_per_page)

    def stats(self) -> dict:
        return {"shared_blocks_exported": self.counts["exported"], "shared_blocks_received": self.counts["received"]}


# -- the wire ------------------------------------------------------------------------------------


def encode_blocks(blocks: list[tuple[bytes, HostBlock]]) -> bytes:
    """Blocks as one safetensors file: their hashes, page sums and each page's wire arrays."""
    tensors: dict[str, np.ndarray] = {
        "hashes": np.frombuffer(b"".join(h for h, _ in blocks), np.uint8).reshape(len(blocks), -1),
        "sums": np.array([b.page_sum for _, b in blocks], np.uint64),
    }
    for i, (_, block) in enumerate(blocks):
        for j, array in enumerate(block.arrays):
            tensors[f"page{i}.array{j}"] = np.ascontiguousarray(array)
    return save_tensors(tensors)


def decode_blocks(data: bytes) -> list[tuple[bytes, HostBlock]]:
    """The blocks of `encode_blocks`' bytes; ValueError if they are not such bytes."""
    try:
        tensors = load_tensors(data)
    except SafetensorError as e:
        raise ValueError(f"the blocks are not a safetensors file: {e}") from None
    if "hashes" not in tensors or "sums" not in tensors:
        raise ValueError("the blocks' file has no hashes or sums")
    hashes, sums = tensors["hashes"], tensors["sums"]
    if hashes.ndim != 2 or sums.ndim != 1 or len(hashes) != len(sums):
        raise ValueError("the blocks' hashes and sums do not match")
    blocks = []
    for i in range(len(sums)):
        arrays: list[np.ndarray] = []
        while (name := f"page{i}.array{len(arrays)}") in tensors:
            arrays.append(tensors[name])
        blocks.append((hashes[i].tobytes(), HostBlock(arrays, int(sums[i]))))
    return blocks


def blocks_tag(secret: DeploymentSecret, identity: bytes, hashes: list[bytes], data: bytes) -> str:
    """The holder's signature of its answer to a /kv/blocks: over the model identity and the
    hashes it was asked for, and the bytes it sends."""
    return secret.sign(TAG_PURPOSE, identity, b"".join(hashes), data).hex()


def asked_for(blocks: list[tuple[bytes, HostBlock]], hashes: list[bytes]) -> list[tuple[bytes, HostBlock]]:
    """The blocks that are, in order, the leading run of `hashes`: the first block under
    another hash ends them (it and everything after it are dropped)."""
    kept = []
    for (block_hash, block), wanted in zip(blocks, hashes):
        if block_hash != wanted:
            break
        kept.append((block_hash, block))
    return kept


def fetch_blocks(
    http: httpx.Client,
    control: str,
    hashes: list[bytes],
    identity: bytes,
    secret: DeploymentSecret,
    timeout_s: float = FETCH_TIMEOUT_S,
) -> list[tuple[bytes, HostBlock]]:
    """The blocks another group (at `control`) holds of `hashes`, leading run first, if it runs
    the model of this `identity`; raises httpx.HTTPError when it refuses or does not answer in
    time, ValueError when its answer is not signed with the deployment secret or not blocks."""
    body = {"hashes": [h.hex() for h in hashes], "identity": identity.hex()}
    r = http.post(control + "/kv/blocks", json=body, timeout=timeout_s)
    r.raise_for_status()
    try:
        tag = bytes.fromhex(r.headers.get(TAG_HEADER, ""))
    except ValueError:
        tag = b""
    if not secret.verify(TAG_PURPOSE, tag, identity, b"".join(hashes), r.content):
        raise ValueError(f"the answer of {control} is not signed by a group of this deployment")
    return asked_for(decode_blocks(r.content), hashes)
