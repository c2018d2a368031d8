"""KV transfer between groups that span processes: each process moves only its own blocks.

A group of several processes holds each page of its cache split over its devices (layers
over pp, heads over tp), and the two sides of a transfer may split it differently. Cutting
every page array at every boundary of either side's split gives blocks that lie whole on one
sending device and whole on each receiving device that needs them. Each block is sent by the
sending process that holds it (the first device holding it, in mesh order) to each receiving
process that needs it: one published list per (sender process, receiver process) pair, on
the sender's own transfer server. A receiving process pulls only its lists, assembles each of
its devices' parts of the pages, and the group's insert program (run by every process in
lock-step) writes them into its cache. Bytes moved: each block once per receiving process
that holds it, so the prompt's cache size when no block is held by two receiving processes.

Both sides compute the same blocks from two descriptions (mesh shape and global device ids),
which they exchange through the frontend; every device of the deployment is visible to
every process of its jax.distributed cluster, so each side can rebuild the other's shardings.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jfire import sharding
from jfire.errors import JfireError
from jfire.mesh import AXES


def describe(layout) -> dict:
    """What the other side needs to rebuild this side's page shardings."""
    if layout.mesh is None:
        return {"mesh": None, "devices": [layout.devices()[0].id]}
    return {"mesh": [layout.mesh.shape[a] for a in AXES], "devices": [d.id for d in layout.mesh.devices.flat]}


def check_description(desc, what: str) -> None:
    """Raises JfireError unless `desc` is a description `describe` could have made on this
    deployment: a mesh of AXES sizes over that many distinct devices the cluster has."""
    if not isinstance(desc, dict) or set(desc) != {"mesh", "devices"}:
        raise JfireError(f"{what} must be {{'mesh': null or {len(AXES)} axis sizes, 'devices': [device ids]}}")
    mesh, devices = desc["mesh"], desc["devices"]
    if mesh is not None and not (
        isinstance(mesh, list) and len(mesh) == len(AXES) and all(is_int(n) and n >= 1 for n in mesh)
    ):
        raise JfireError(f"{what}: mesh must be null or {len(AXES)} positive axis sizes ({', '.join(AXES)})")
    count = 1 if mesh is None else math.prod(mesh)
    known = {d.id for d in jax.devices()}
    if not (isinstance(devices, list) and len(devices) == count and all(is_int(i) for i in devices)):
        raise JfireError(f"{what}: devices must be the {count} device ids of its mesh")
    if len(set(devices)) != count or not set(devices) <= known:
        raise JfireError(f"{what}: devices must be {count} distinct device ids of this deployment")


def is_int(x) -> TypeGuard[int]:
    """Whether a value read from JSON is an integer (JSON's true and false are not)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _page_sharding(desc: dict, layout, c):
    by_id = {d.id: d for d in jax.devices()}
    if desc["mesh"] is None:
        return SingleDeviceSharding(by_id[desc["devices"][0]])
    mesh = Mesh(np.array([by_id[i] for i in desc["devices"]], dtype=object).reshape(desc["mesh"]), AXES)
    return NamedSharding(mesh, sharding.partition_spec(c.page_axes(), mesh, layout.wire_shape(c)))


def _boxes(sh, shape) -> dict:
    """device -> ((start, stop) per axis) of its part of an array of `shape`."""
    return {
        d: tuple((s.start or 0, shape[a] if s.stop is None else s.stop) for a, s in enumerate(index))
        for d, index in sh.devices_indices_map(shape).items()
    }


def _inside(box, outer) -> bool:
    return all(o0 <= b0 and b1 <= o1 for (b0, b1), (o0, o1) in zip(box, outer))


@dataclasses.dataclass(frozen=True)
class Block:
    array: int  # which cache array (index into layout.arrays)
    box: tuple  # (start, stop) per axis of one page of that array
    sender: object  # the device that sends it
    receivers: tuple  # the receiving devices that hold it

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)


class BlockPlan:
    """The blocks of one page of every cache array, between a sending and a receiving side."""

    def __init__(self, layout, sender: dict, receiver: dict):
        self.layout = layout
        self.blocks: list[Block] = []
        self.receiver_shardings = []
        for a, c in enumerate(layout.arrays):
            shape = layout.wire_shape(c)
            send, receive = _page_sharding(sender, layout, c), _page_sharding(receiver, layout, c)
            self.receiver_shardings.append(receive)
            send_boxes, receive_boxes = _boxes(send, shape), _boxes(receive, shape)
            cuts = [
                sorted({0, n, *(x for box in [*send_boxes.values(), *receive_boxes.values()] for x in box[i])})
                for i, n in enumerate(shape)
            ]
            for box in itertools.product(*[list(zip(c_[:-1], c_[1:])) for c_ in cuts]):
                owner = next(d for d, b in send_boxes.items() if _inside(box, b))
                receivers = tuple(d for d, b in receive_boxes.items() if _inside(box, b))
                self.blocks.append(Block(a, box, owner, receivers))

    def pairs(self) -> set[tuple[int, int]]:
        """(sender process, receiver process) pairs that move anything."""
        return {(b.sender.process_index, d.process_index) for b in self.blocks for d in b.receivers}

    def between(self, sender_process: int, receiver_process: int) -> list[Block]:
        return [
            b
            for b in self.blocks
            if b.sender.process_index == sender_process
            and any(d.process_index == receiver_process for d in b.receivers)
        ]

    def structs(self, sender_process: int, receiver_process: int, num_pages: int) -> list:
        """What the receiving process pulls from the sending one: page-major, block by block,
        each onto the receiver's first local device that holds it."""
        dtype = self.layout.dtype
        one = [
            jax.ShapeDtypeStruct(
                b.shape,
                dtype,
                sharding=SingleDeviceSharding(next(d for d in b.receivers if d.process_index == receiver_process)),
            )
            for b in self.between(sender_process, receiver_process)
        ]
        return one * num_pages


def pair_uuid(base: int, sender_process: int, receiver_process: int) -> int:
    """The id one (sender, receiver) list is published under."""
    return (base ^ (sender_process << 24) ^ (receiver_process << 44)) & ((1 << 62) - 1)


def pieces_to_send(plan: BlockPlan, wire: list, receiver_process: int) -> list[jax.Array]:
    """This process's blocks for one receiving process, cut from its shards of the gathered
    pages (`wire`: page-major, one global array per cache array)."""
    me, n = jax.process_index(), len(plan.layout.arrays)
    blocks = plan.between(me, receiver_process)
    out = []
    for page in range(len(wire) // n):
        shards = [{s.device: s for s in wire[page * n + a].addressable_shards} for a in range(n)]
        for b in blocks:
            shard = shards[b.array][b.sender]
            start = [s.start or 0 for s in shard.index]
            out.append(shard.data[tuple(slice(lo - s0, hi - s0) for (lo, hi), s0 in zip(b.box, start))])
    return out


def assemble(plan: BlockPlan, pulled: dict[int, list], num_pages: int) -> list[jax.Array]:
    """Global page arrays (page-major) in the receiver's page sharding, from the lists this
    process pulled (sender process -> arrays as `structs` ordered them). A list that did not
    arrive (None) leaves zeros: the transfer's checksum then fails the request."""
    me, dtype = jax.process_index(), plan.layout.dtype
    per_sender = {p: plan.between(p, me) for p in pulled}
    out = []
    for page in range(num_pages):
        for a, c in enumerate(plan.layout.arrays):
            shape, sh = plan.layout.wire_shape(c), plan.receiver_shardings[a]
            boxes = _boxes(sh, shape)
            parts = []
            for d in sh.addressable_devices_indices_map(shape):
                box = boxes[d]
                part = jnp.zeros(tuple(b - a_ for a_, b in box), dtype, device=d)
                for p, blocks in per_sender.items():
                    arrays = pulled[p]
                    for i, b in enumerate(blocks):
                        if b.array != a or d not in b.receivers or arrays is None:
                            continue
                        piece = jax.device_put(arrays[page * len(blocks) + i], d)
                        part = part.at[tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(b.box, box))].set(
                            piece
                        )
                parts.append(part)
            out.append(jax.make_array_from_single_device_arrays(shape, sh, parts))
    return out


class BlockPulls:
    """This process's pulls of one transfer, one per sending process, each with its own
    deadline (kv_transfer.Pull, run by the process's Puller); polled like a single Pull."""

    def __init__(self, puller, layout, transfer: dict, timeout_s: float):
        me = jax.process_index()
        self.plan = BlockPlan(layout, transfer["sender"], describe(layout))
        self.num_pages = transfer["num_pages"]
        self.pulls = {
            p: puller.pull(
                transfer["addresses"][str(p)],
                pair_uuid(transfer["uuid"], p, me),
                self.plan.structs(p, me, self.num_pages),
                timeout_s,
            )
            for p, q in sorted(self.plan.pairs())
            if q == me
        }

    @property
    def done(self) -> bool:
        return all(p.done for p in self.pulls.values())

    @property
    def expired(self) -> bool:
        return any(p.expired for p in self.pulls.values())

    @property
    def error(self) -> str | None:
        return next((p.error for p in self.pulls.values() if p.error is not None), None)

    def wait(self) -> None:
        """Until every pull is done or past its deadline."""
        import time

        while not self.done and not self.expired:
            time.sleep(0.002)

    def arrays(self) -> tuple[list[jax.Array], int]:
        """The pages in this side's page layout (zeros where a pull failed), and the bytes pulled."""
        pulled = {p: pull.arrays if pull.done and pull.error is None else None for p, pull in self.pulls.items()}
        nbytes = sum(a.nbytes for arrays in pulled.values() if arrays for a in arrays)
        return assemble(self.plan, pulled, self.num_pages), nbytes


BYTES_DIR = "jfire/kv-bytes/"


def report_bytes(store, group: str, nbytes: int) -> None:
    """This process's KV bytes so far (sent or pulled), where its group's leader reads them."""
    store.key_value_set(f"{BYTES_DIR}{group}/{jax.process_index()}", str(nbytes), allow_overwrite=True)


def read_bytes(store, group: str) -> dict[str, int]:
    """process id -> the KV bytes it reported, for every process of the group that has."""
    return {key.rsplit("/", 1)[1]: int(value) for key, value in store.key_value_dir_get(f"{BYTES_DIR}{group}/")}
