"""Joining the deployment's jax.distributed cluster, and its key-value store.

Every process of a deployment is one jax.distributed process; the frontend (process 0)
hosts the coordinator service. The store carries small messages: where each group's control
server and transfer server listen, and the decode side's word on each KV transfer: pulled or
dropped, still wanted (renewed while it waits for pages), or given up.

Recoverability is switched on so that one group dying does not take the others down: the
frontend reports it on /health and routes around it, and a restarted process joins again
under its old process id and registers anew.

Every value jfire keeps there is signed with the deployment secret (jfire.disagg.signed_store):
the coordinator lets anyone who reaches its port read and write, so the port must stay on the
deployment's private network (docs/security.md), and it listens on the address it is given only.
"""

from __future__ import annotations

import json
import os
import sys

import jax

from jfire.deployment_secret import DeploymentSecret
from jfire.disagg.signed_store import SignedStore
from jfire.errors import JfireError

GROUPS_DIR = "jfire/groups/"


def join(
    coordinator: str,
    num_processes: int,
    process_id: int,
    *,
    secret: DeploymentSecret,
    init_timeout_s: int = 300,
    recoverable: bool = True,
    collectives: bool = True,
    what: str = "the deployment",
) -> SignedStore:
    """Joins the cluster (blocks until every process has joined) and returns the store, its
    values signed with `secret`. `recoverable` (a deployment): one process dying leaves the
    others running; without it (one engine spanning processes) JAX stops every process once
    one stops answering. `collectives`: whether this process computes with others (a group
    spanning processes); without them it opens no CPU collectives (gloo) listener, a port
    that authenticates nobody and that JAX binds wherever the host's name resolves."""
    if recoverable:
        jax.config.update("jax_enable_recoverability", True)
    if not collectives:
        jax.config.update("jax_cpu_collectives_implementation", None)
    try:
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=10,
            coordinator_bind_address=bind_address(coordinator) if process_id == 0 else None,
        )
    except Exception as e:  # noqa: BLE001 - jax raises plain RuntimeErrors/XlaRuntimeErrors here
        raise JfireError(
            f"could not join {what} at {coordinator} as process {process_id} of {num_processes}: {e}"
        ) from None
    jax.devices()  # every process must bring up its backend before any can use it
    return store(secret)


def bind_address(coordinator: str) -> str:
    """Where process 0's coordinator service listens: the address the others are told to
    connect to, and nothing else (JAX's own default is every interface, [::]:PORT). A host
    name binds what it resolves to on process 0's host. $JAX_COORDINATOR_BIND_ADDRESS, JAX's
    own setting, wins when the operator sets it (an address behind NAT, or a name that
    resolves to loopback on its own host: 127.0.1.1 on Debian's defaults)."""
    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return os.environ["JAX_COORDINATOR_BIND_ADDRESS"]
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    if host not in ("127.0.0.1", "::1", "localhost") and _loopback_only(host):
        print(
            f"jfire: warning: the coordinator address {coordinator} resolves to a loopback address on this "
            "host: processes on other hosts cannot reach it. Give --coordinator an address of this host's "
            "private network, or set JAX_COORDINATOR_BIND_ADDRESS to one.",
            file=sys.stderr,
            flush=True,
        )
    return coordinator


def _loopback_only(host: str) -> bool:
    import ipaddress
    import socket

    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False  # JAX says what is wrong with a name that does not resolve
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def store(secret: DeploymentSecret) -> SignedStore:
    """This process's store (it has joined a cluster), its values signed with `secret`."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise JfireError("this process has not joined a deployment (jax.distributed is not initialised)")
    return SignedStore(client, secret)


def publish_group(client, name: str, info: dict) -> None:
    client.key_value_set(GROUPS_DIR + name, json.dumps(info), allow_overwrite=True)


def read_group(client, name: str) -> dict | None:
    """What a group registered last (a restarted group registers again), or None (nothing
    yet, or nothing signed: said on stderr)."""
    try:
        return _registration(GROUPS_DIR + name, client.key_value_try_get(GROUPS_DIR + name))
    except JfireError as e:
        print(f"jfire: warning: {e}", file=sys.stderr, flush=True)
        return None
    except Exception:  # noqa: BLE001 - the store raises NotFound as a plain runtime error
        return None


def wait_group(client, name: str, timeout_s: float) -> dict:
    return _registration(GROUPS_DIR + name, client.blocking_key_value_get(GROUPS_DIR + name, int(timeout_s * 1000)))


def _registration(key: str, value: str) -> dict:
    try:
        info = json.loads(value)
    except ValueError:
        info = None
    if not isinstance(info, dict):
        raise JfireError(f"the cluster store's value under {key!r} is not a group's registration")
    return info


def take_all(client: SignedStore, directory: str) -> list[tuple[int, str]]:
    """Reads and deletes every key under directory (one of the per-transfer keys below, given
    uuid ""): [(uuid, value)]. The engine thread polls these, so what would fail it is dropped
    with a line on stderr instead: a value not signed with the deployment's secret, a key that
    names no transfer, a value that key never holds (`valid_value`)."""
    taken: list[tuple[int, str]] = []
    refused: list[str] = []
    for key, value in client.key_value_dir_get(directory, refused=refused):
        uuid = key.rsplit("/", 1)[1]
        if uuid.isdigit() and len(uuid) <= MAX_UUID_DIGITS and valid_value(directory, value):
            client.key_value_delete(key)
            taken.append((int(uuid), value))
        else:
            refused.append(key)
    for key in refused:  # once: a stranger's key is not warned about at every poll
        client.key_value_delete(key)
    if refused:
        print(f"jfire: warning: ignored malformed or unsigned store keys: {', '.join(refused[:4])}", file=sys.stderr)
    return taken


MAX_UUID_DIGITS = 40  # a transfer id is a 128-bit integer at most
ACKS_DIR, RENEW_DIR, ABANDONED_DIR = "jfire/acks/", "jfire/renew/", "jfire/abandoned/"


def valid_value(directory: str, value: str) -> bool:
    """Whether value has the form its directory's keys hold: an ack says PULLED or DROPPED (an
    abandon note's shape is checked by its reader, against its pool; a renewal's is not read)."""
    return value in (PULLED, DROPPED) if directory.startswith(ACKS_DIR) else True


def ack_key(prefill_group: str, uuid) -> str:
    """Set by the decode side once it has a transfer's KV cache (value PULLED), or on its
    behalf when the request ended before the pull (value DROPPED)."""
    return f"{ACKS_DIR}{prefill_group}/{uuid}"


PULLED, DROPPED = "pulled", "dropped"


def renew_key(prefill_group: str, uuid) -> str:
    """Set again and again by a decode group while a request waits there for pages: the
    prefill group keeps its KV cache for another timeout instead of releasing it."""
    return f"{RENEW_DIR}{prefill_group}/{uuid}"


def abandon_key(prefill_group: str, uuid) -> str:
    """Where a decode group leaves word that it gave up pulling a transfer (see kv_transfer)."""
    return f"{ABANDONED_DIR}{prefill_group}/{uuid}"


def incarnation(client, group: str, processes: int) -> str:
    """The name a group spanning processes runs under this time: each of its processes counts
    itself in once per start, so N processes starting (or restarting together) agree on one
    number, and nothing an earlier life of the group left in the store is read again."""
    joined = client.key_value_increment(f"jfire/incarnations/{group}", 1)
    return f"{group}/{(joined - 1) // processes}"


def transfer_key(group_incarnation: str, process_id: int) -> str:
    """Where a follower of a group leaves the address of its own transfer server."""
    return f"jfire/transfers/{group_incarnation}/{process_id}"


def forget_collectives(client: SignedStore, device_ids: set[int]) -> int:
    """Deletes what an earlier life of a group left of its gloo rendezvous (CPU collectives
    meet under keys naming their devices, which a restarted group reuses); returns how many.
    Runs before any process of the group starts a collective. (Those keys are JAX's, unsigned:
    only their names are read.)"""
    stale = []
    for key in client.foreign_keys("cpu:gloo/"):
        clique = key.split("/")[1] if key.count("/") >= 2 else ""
        ids = {int(x) for x in clique.split(",") if x.isdigit()}
        if ids and ids <= device_ids:
            stale.append(key)
    for key in stale:
        client.key_value_delete(key)
    return len(stale)
