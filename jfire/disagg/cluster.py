"""Joining the deployment's jax.distributed cluster, and its key-value store.

Every process of a deployment is one jax.distributed process; the frontend (process 0)
hosts the coordinator service. The store carries small messages: where each group's control
server and transfer server listen, and the decode side's word on each KV transfer: pulled or
dropped, still wanted (renewed while it waits for pages), or given up.

Recoverability is switched on so that one group dying does not take the others down: the
frontend reports it on /health and routes around it, and a restarted process joins again
under its old process id and registers anew.
"""

from __future__ import annotations

import json

import jax

from jfire.errors import JfireError

GROUPS_DIR = "jfire/groups/"


def join(
    coordinator: str,
    num_processes: int,
    process_id: int,
    *,
    init_timeout_s: int = 300,
    recoverable: bool = True,
    what: str = "the deployment",
):
    """Joins the cluster (blocks until every process has joined) and returns the store client.
    `recoverable` (a deployment): one process dying leaves the others running; without it (one
    engine spanning processes) JAX stops every process once one stops answering."""
    if recoverable:
        jax.config.update("jax_enable_recoverability", True)
    try:
        jax.distributed.initialize(
            coordinator, num_processes, process_id, initialization_timeout=init_timeout_s, heartbeat_timeout_seconds=10
        )
    except Exception as e:  # noqa: BLE001 - jax raises plain RuntimeErrors/XlaRuntimeErrors here
        raise JfireError(
            f"could not join {what} at {coordinator} as process {process_id} of {num_processes}: {e}"
        ) from None
    jax.devices()  # every process must bring up its backend before any can use it
    return store()


def store():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise JfireError("this process has not joined a deployment (jax.distributed is not initialised)")
    return client


def publish_group(client, name: str, info: dict) -> None:
    client.key_value_set(GROUPS_DIR + name, json.dumps(info), allow_overwrite=True)


def read_group(client, name: str) -> dict | None:
    """What a group registered last (a restarted group registers again), or None."""
    try:
        return json.loads(client.key_value_try_get(GROUPS_DIR + name))
    except Exception:  # noqa: BLE001 - the store raises NotFound as a plain runtime error
        return None


def wait_group(client, name: str, timeout_s: float) -> dict:
    return json.loads(client.blocking_key_value_get(GROUPS_DIR + name, int(timeout_s * 1000)))


def take_all(client, directory: str) -> list[tuple[int, str]]:
    """Reads and deletes every key under directory (one of the per-transfer keys below, given
    uuid ""): [(uuid, value)]."""
    taken = []
    for key, value in client.key_value_dir_get(directory):
        client.key_value_delete(key)
        taken.append((int(key.rsplit("/", 1)[1]), value))
    return taken


def ack_key(prefill_group: str, uuid) -> str:
    """Set by the decode side once it has a transfer's KV cache (value PULLED), or on its
    behalf when the request ended before the pull (value DROPPED)."""
    return f"jfire/acks/{prefill_group}/{uuid}"


PULLED, DROPPED = "pulled", "dropped"


def renew_key(prefill_group: str, uuid) -> str:
    """Set again and again by a decode group while a request waits there for pages: the
    prefill group keeps its KV cache for another timeout instead of releasing it."""
    return f"jfire/renew/{prefill_group}/{uuid}"


def abandon_key(prefill_group: str, uuid) -> str:
    """Where a decode group leaves word that it gave up pulling a transfer (see kv_transfer)."""
    return f"jfire/abandoned/{prefill_group}/{uuid}"


def incarnation(client, group: str, processes: int) -> str:
    """The name a group spanning processes runs under this time: each of its processes counts
    itself in once per start, so N processes starting (or restarting together) agree on one
    number, and nothing an earlier life of the group left in the store is read again."""
    joined = client.key_value_increment(f"jfire/incarnations/{group}", 1)
    return f"{group}/{(joined - 1) // processes}"


def transfer_key(group_incarnation: str, process_id: int) -> str:
    """Where a follower of a group leaves the address of its own transfer server."""
    return f"jfire/transfers/{group_incarnation}/{process_id}"


def forget_collectives(client, device_ids: set[int]) -> int:
    """Deletes what an earlier life of a group left of its gloo rendezvous (CPU collectives
    meet under keys naming their devices, which a restarted group reuses); returns how many.
    Runs before any process of the group starts a collective."""
    stale = []
    for key, _ in client.key_value_dir_get_bytes("cpu:gloo/"):
        clique = key.split("/")[1] if key.count("/") >= 2 else ""
        ids = {int(x) for x in clique.split(",") if x.isdigit()}
        if ids and ids <= device_ids:
            stale.append(key)
    for key in stale:
        client.key_value_delete(key)
    return len(stale)
