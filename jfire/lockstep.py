"""One engine over several processes, in lock-step: JAX's multi-controller model.

A group too large for one host runs as N processes. Each holds its own devices of one global
mesh (`jax.distributed`; collectives cross processes: gloo on CPU, NCCL on GPUs) and every
process must call the same compiled program, with the same inputs, in the same order. The
leader (the group's first process) runs the scheduler like any engine; every device call it
makes (`ModelRunner.call`: which program, its shape, its host inputs) goes first to each
follower through the jax.distributed key-value store, numbered. Followers only replay calls,
in order: one that receives a number out of sequence, or a call to a program it does not
have, fails loudly rather than run something the leader did not.

Every process of a group holds the deployment secret: each call travels in a plain format
(jfire.lockstep_wire: JSON and raw array bytes, never pickle), signed with it through the store
(jfire.disagg.signed_store), its number inside what is signed. A call that does not verify is
never parsed: the follower fails with the key's name, and the group with it.

The leader also posts its configuration (model, mesh, page pool, buckets) before the first
call; a follower started with other settings refuses to run instead of diverging later.

Every process beats in the store (a counter, once a second). A follower stops when its leader
neither calls nor beats for LEADER_TIMEOUT_S; a leader fails (its requests end with an error and
the group goes down) when a follower has not beaten for FOLLOWER_TIMEOUT_S, so a follower dying
while the group is idle is noticed then, not at the next request's first collective.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable

from jfire import deployment_secret, lockstep_wire
from jfire.deployment_secret import DeploymentSecret
from jfire.disagg import cluster
from jfire.disagg.signed_store import SignedStore
from jfire.errors import JfireError

STEPS_DIR = "jfire/lockstep/"
POLL_MS = 1000  # how long a follower's read waits before it looks again (the leader may be idle)
BEAT_S = 1.0  # every process's sign of life, this often
LEADER_TIMEOUT_S = 15.0  # a follower that hears nothing from its leader for this long stops
FOLLOWER_TIMEOUT_S = (
    10.0  # a leader whose follower shows no sign of life for this long fails (JAX's own heartbeat timeout)
)


def check_group(num_processes: int, process_id: int, secret: DeploymentSecret | None) -> DeploymentSecret:
    """Refuses a group's flags, or a process of a group given no deployment secret
    (deployment_secret.from_env), before anything joins; returns the secret."""
    if num_processes < 2:
        raise JfireError(f"--num-processes must be >= 2 for a group spanning processes, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise JfireError(f"--process-id must be in 0..{num_processes - 1}, got {process_id}")
    if secret is None:
        raise JfireError(deployment_secret.missing("a group spanning processes"))
    return secret


def join(coordinator: str, num_processes: int, process_id: int, secret: DeploymentSecret | None) -> SignedStore:
    """Joins the group's jax.distributed cluster (process 0 hosts the coordinator service);
    blocks until every process has joined, and returns the group's store, signed with the
    secret every process of the group was given. A process whose peer stops answering is
    shut down by JAX: a group lives and dies whole."""
    secret = check_group(num_processes, process_id, secret)
    return cluster.join(coordinator, num_processes, process_id, secret=secret, recoverable=False, what="the group")


def fingerprint(engine) -> dict:
    """What every process of a group must agree on for its programs and page tables to match."""
    model, config = engine.model, engine.config
    return {
        "model": model.name,
        "dtype": model.dtype,
        "mesh": str(dict(model.mesh.shape)) if model.mesh else None,
        "devices": [d.id for d in model.mesh.devices.flat] if model.mesh else None,
        "pages": engine.pool.num_pages,
        "page_size": config.page_size,
        "max_model_len": engine.max_model_len,
        "buckets": repr(engine.runner.buckets),
        "attention": config.attention,
    }


class StepChannel:
    """The leader's end (`send`) or a follower's (`receive`) of a group's stream of device calls."""

    def __init__(self, group: str, processes: list[int], me: int, store: SignedStore):
        self.store = store
        self.group = group
        self.leader, self.followers = processes[0], [p for p in processes if p != processes[0]]
        self.me = me
        self.seq = 0
        self._last_beat = 0.0
        self._heard: dict[int, tuple[int, float]] = {}  # follower -> (its last beat, when it changed)

    def _key(self, follower: int, seq: int) -> str:
        return f"{STEPS_DIR}{self.group}/{follower}/{seq}"

    def _config_key(self) -> str:
        return f"{STEPS_DIR}{self.group}/config"

    # -- the leader ----------------------------------------------------------------------------

    def post_config(self, engine) -> None:
        self.store.key_value_set(self._config_key(), json.dumps(fingerprint(engine)), allow_overwrite=True)

    def send(self, kind: str, key, inputs) -> None:
        """Numbers the call and leaves it for every follower; it runs right after on the leader."""
        payload = lockstep_wire.encode(self.seq + 1, kind, key, inputs)  # refuses what cannot travel, unsent
        self.seq += 1
        for follower in self.followers:
            self.store.key_value_set_bytes(self._key(follower, self.seq), payload)

    def beat(self) -> None:
        """The leader's sign of life while it sends nothing, and its check of its followers'
        (called every loop of its engine). Raises JfireError when a follower that had beaten
        has been silent for FOLLOWER_TIMEOUT_S."""
        now = time.monotonic()
        if now - self._last_beat < BEAT_S:
            return
        self._last_beat = now
        self.store.key_value_increment(self._beat_key(self.leader), 1)
        for follower in self.followers:
            beat = self._read_beat(follower)
            last = self._heard.get(follower)
            if beat is not None and (last is None or beat != last[0]):
                self._heard[follower] = (beat, now)
            elif last is not None and now - last[1] > FOLLOWER_TIMEOUT_S:
                raise JfireError(
                    f"process {follower} of the group stopped: no sign of life for {FOLLOWER_TIMEOUT_S:g} s"
                )

    def _beat_key(self, process: int) -> str:
        return f"{STEPS_DIR}{self.group}/beat/{process}"

    def _read_beat(self, process: int) -> int | None:
        """Its count of beats, None before its first (a counter: see signed_store's note)."""
        return self.store.read_counter(self._beat_key(process))

    def stop(self) -> None:
        """Tells followers the leader is done (they exit with status 0)."""
        try:
            self.send("stop", None, None)
        except Exception:  # noqa: BLE001 - the group is already going down
            pass

    # -- a follower ----------------------------------------------------------------------------

    def beat_forever(self) -> Callable[[], None]:
        """A follower's sign of life, from a daemon thread until the returned function is called
        (a long compile or a slow call does not silence it, nor does one failed store call;
        death does). The follower stops it before leaving, so that no beat is in flight while
        jax.distributed shuts its client down (a store call racing the shutdown aborts the
        process)."""
        stopped = threading.Event()

        def run():
            while not stopped.is_set():
                try:
                    self.store.key_value_increment(self._beat_key(self.me), 1)
                except Exception:  # noqa: BLE001 - a passing store error: the next beat tries again
                    pass
                stopped.wait(BEAT_S)

        thread = threading.Thread(target=run, name="jfire-beat", daemon=True)
        thread.start()

        def stop():
            stopped.set()
            thread.join(timeout=2 * BEAT_S)

        return stop

    def check_config(self, engine, timeout_s: float = 600) -> None:
        try:
            leader = json.loads(self.store.blocking_key_value_get(self._config_key(), int(timeout_s * 1000)))
        except JfireError:  # not signed with the group's secret
            raise
        except Exception as e:  # noqa: BLE001
            raise JfireError(f"the group's leader posted no configuration within {timeout_s:.0f} s: {e}") from None
        if not isinstance(leader, dict):
            raise JfireError(f"the group's configuration under {self._config_key()!r} is not a JSON object")
        mine = fingerprint(engine)
        differ = {k: (leader.get(k), v) for k, v in mine.items() if leader.get(k) != v}
        if differ:
            detail = "; ".join(f"{k}: leader {a!r}, this process {b!r}" for k, (a, b) in differ.items())
            raise JfireError(
                f"process {self.me} was started with settings that differ from the group leader's "
                f"({detail}); start every process of a group with the same model, mesh and engine flags"
            )

    def receive(self):
        """The next call: (kind, key, inputs). Waits as long as the leader is idle."""
        self.seq += 1
        key = self._key(self.me, self.seq)
        beat, heard = None, time.monotonic()
        while True:
            try:
                payload = self.store.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except JfireError:  # not signed with the group's secret: never parsed
                raise
            except Exception as e:  # noqa: BLE001 - a plain runtime error: deadline or lost coordinator
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise JfireError(f"process {self.me} lost its group's leader: {e}") from None
            # An idle leader beats; one that neither sends nor beats has died (where JAX does
            # not stop the group itself: a deployment's processes outlive each other).
            now_beat = self._read_beat(self.leader)
            if now_beat != beat:
                beat, heard = now_beat, time.monotonic()
            elif beat is not None and time.monotonic() - heard > LEADER_TIMEOUT_S:  # it had beaten before
                raise JfireError(
                    f"process {self.me} lost its group's leader (process {self.leader}): no call and "
                    f"no sign of life for {LEADER_TIMEOUT_S:g} s"
                )
        self.store.key_value_delete(key)
        seq, kind, call_key, inputs = lockstep_wire.decode(payload, key)
        if seq != self.seq:
            raise JfireError(
                f"process {self.me} diverged from its group: it expected call {self.seq} and received call {seq}"
            )
        return kind, call_key, inputs


def follow(engine, channel: StepChannel, on_ready=None) -> int:
    """A follower's whole life: compile what the leader compiles, check the leader's
    settings (then `on_ready()`), then replay every call until the leader stops (returns 0)."""
    if threading.current_thread() is threading.main_thread():
        # A supervisor stopping the group signals every process: the follower goes on until the
        # leader, draining its requests, sends its last call (or JAX stops it with the leader).
        signal.signal(
            signal.SIGTERM,
            lambda *_: print(
                f"jfire: process {channel.me} follows on until its leader stops", file=sys.stderr, flush=True
            ),
        )
    stop_beating = channel.beat_forever()
    try:
        return _replay(engine, channel, on_ready)
    finally:
        stop_beating()


def _replay(engine, channel: StepChannel, on_ready) -> int:
    engine.start(run_loop=False)
    engine.programs.lazy = True  # a program the leader has and this process not yet: compile it now
    channel.check_config(engine)
    if on_ready is not None:
        on_ready()
    print(
        f"jfire: process {channel.me} follows process {channel.leader} ({engine.programs.num_compiled} "
        f"programs compiled)",
        file=sys.stderr,
        flush=True,
    )
    try:
        while True:
            kind, key, inputs = channel.receive()
            if kind == "stop":
                return 0
            if kind not in engine.runner.call_kinds:
                raise JfireError(
                    f"process {channel.me} received an unknown call {kind!r}: the group's processes "
                    "run different jfire versions"
                )
            out = engine.runner.apply(kind, key, inputs)
            if hasattr(out, "ids"):  # errors surface at the call that caused them
                out.ids.block_until_ready()
    finally:
        engine.shutdown()
