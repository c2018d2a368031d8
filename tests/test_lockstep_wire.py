"""What a group's leader sends its followers (jfire.lockstep, jfire.lockstep_wire): every kind of
call the runner makes arrives exactly as it was sent (values, types, dtypes), what cannot travel
is refused at the leader, and a call the deployment secret did not sign is refused by the
follower with the key's name, unparsed: a pickle written into a step key runs nothing, on a
real two-process jax.distributed cluster too."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jfire import lockstep, lockstep_wire
from jfire.deployment_secret import DeploymentSecret, to_env
from jfire.disagg.launch import free_port
from jfire.disagg.signed_store import SignedStore
from jfire.errors import JfireError
from jfire.program_inputs import Extras
from jfire.sampling import RowSampling
from jfire.speculative.model_drafts import DraftIn
from tests.memory_store import MemoryClient

REPO = Path(__file__).resolve().parents[1]
SECRET = DeploymentSecret(bytes(range(32)))


def channels(secret=SECRET):
    client = MemoryClient()
    leader = lockstep.StepChannel("g", [0, 1], 0, SignedStore(client, SECRET))
    follower = lockstep.StepChannel("g", [0, 1], 1, SignedStore(client, secret))
    return client, leader, follower


def sampling(rows: int) -> RowSampling:
    return RowSampling(np.arange(rows, dtype=np.uint32), np.full(rows, 0.7, np.float32), np.zeros(rows, np.int32),
                       np.ones(rows, np.float32), np.full((rows, 2), -1, np.int32), np.zeros(rows, np.float32),
                       np.zeros(rows, np.float32), np.ones(rows, np.float32), np.arange(rows, dtype=np.int32),
                       np.array([True, False] * (rows // 2)))


def tokens(rows, t):
    return np.arange(rows * t, dtype=np.int32).reshape(rows, t)


# One of each call the runner and the connectors make (runner.apply's kinds), as they build them.
CALLS = [
    ("decode", (4,), (tokens(4, 1)[:, 0], np.full(4, -1, np.int32), tokens(4, 3), sampling(4))),
    ("prefill", (2, 8), (tokens(2, 8), tokens(2, 8), tokens(2, 3), np.array([7, 3], np.int32), sampling(2),
                         np.full((2, 8), -1, np.int32),
                         Extras(DraftIn(tokens(2, 8), np.array([8, 8], np.int32)),
                                (np.zeros((2, 8, 4), np.float32), np.zeros((2, 8), bool))))),
    ("verify", (2, 4), (tokens(2, 4), tokens(2, 4), tokens(2, 3), np.array([3, 0], np.int32), sampling(2),
                        Extras(DraftIn(tokens(2, 4), np.array([4, 4], np.int32))))),
    ("penalty", 5, (np.arange(16, dtype=np.int32), np.zeros(16, bool))),
    ("publish", 2**61 + 3, ([4, 5, 6], {"mesh": {"tp": 2}, "devices": [0, 1], "name": "d0"})),
    ("release", 17, True),
    ("pull", 2**127 + 1, {"uuid": 9, "num_pages": 3, "group": "p0", "addresses": {"0": "127.0.0.1:1"},
                          "checksum": 1.5e9, "codec": None, "sender": {"heads": 8}}),
    ("insert", 9, [1, 2, 3]),
    ("forget", 9, None),
    ("decode", (np.int64(4),), (np.float32(0.5), np.bool_(True), [], (), {})),
]


def same(a, b) -> bool:
    """Equal values of the same types (and dtypes and shapes, for arrays), all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def test_every_kind_of_call_arrives_as_it_was_sent():
    _, leader, follower = channels()
    received = []
    for kind, key, inputs in CALLS:
        leader.send(kind, key, inputs)
        received.append(follower.receive())
        assert same(received[-1], (kind, key, inputs)), kind
    assert received[0][2][0].flags.writeable  # as the leader's own arrays are


@pytest.mark.parametrize("inputs,where", [
    ((np.array([object()]),), "inputs[0]"),
    ((jnp.zeros(2),), "inputs[0]"),
    ({"a": {1, 2}}, "inputs['a']"),
    (({(1, 2): 3},), "inputs[0]"),
    ((pickle,), "inputs[0]"),
])
def test_what_cannot_travel_is_refused_at_the_leader(inputs, where):
    client, leader, _ = channels()
    with pytest.raises(JfireError, match=r"lock-step call") as refused:
        leader.send("decode", (1,), inputs)
    assert where in str(refused.value)
    assert leader.seq == 0 and client.values == {}  # nothing sent, the next call keeps its number


class Bomb:
    """What a pickle-reading follower would run: creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def forged_payloads(marker: Path) -> dict[str, bytes]:
    key = "jfire/lockstep/g/1/1"
    payload = lockstep_wire.encode(1, "decode", (4,), CALLS[0][2])
    other = DeploymentSecret(b"\x01" * 32)
    return {
        "a pickle, as a follower used to read": zlib.compress(pickle.dumps(Bomb(marker))),
        "a call signed with another secret": other.sign("store", key.encode(), payload).hex().encode() + payload,
        "a call signed for another key": SECRET.sign("store", b"jfire/lockstep/g/1/2", payload).hex().encode() + payload,
        "nothing": b"",
    }


def test_a_forged_call_is_refused_with_its_key_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    for what, forged in forged_payloads(marker).items():
        client, _, follower = channels()
        client.key_value_set_bytes("jfire/lockstep/g/1/1", forged)
        with pytest.raises(JfireError, match="'jfire/lockstep/g/1/1' is not signed with this deployment's secret"):
            follower.receive()
        assert not marker.exists(), what


def test_a_follower_with_another_secret_refuses_its_leaders_calls():
    _, leader, follower = channels(secret=DeploymentSecret(b"\x02" * 32))
    leader.send(*CALLS[0])
    with pytest.raises(JfireError, match="not signed with this deployment's secret"):
        follower.receive()


@pytest.mark.parametrize("body", [
    b"not zlib",
    zlib.compress(b"\x05\x00\x00\x00\x00\x00\x00\x00{}"),  # a header cut short
    zlib.compress(b"\x02\x00\x00\x00\x00\x00\x00\x00{}"),  # no fields
])
def test_a_signed_but_malformed_call_is_refused_with_its_key(body):
    client, _, follower = channels()
    SignedStore(client, SECRET).key_value_set_bytes("jfire/lockstep/g/1/1", body)
    with pytest.raises(JfireError, match="the lock-step call under 'jfire/lockstep/g/1/1' is malformed"):
        follower.receive()


@pytest.mark.parametrize("header", [
    {"arrays": [["object", [1], 0]]},  # a dtype that could hold anything
    {"arrays": [["int32", [1 << 40], 0]]},  # more than the payload holds
    {"arrays": [["int32", [-1], 0]]},
    {"inputs": {"N": "Popen", "F": []}},  # a type outside the programs' inputs
    {"inputs": {"A": -1}},
    {"inputs": {"Q": 1}},
    {"inputs": {"D": [[[1], 2]]}},  # an unhashable key
])
def test_a_header_can_describe_only_plain_data(header):
    full = {"seq": 1, "kind": "decode", "key": None, "inputs": None, "arrays": [], **header}
    head = json.dumps(full).encode()
    payload = zlib.compress(len(head).to_bytes(8, "little") + head + b"\0" * 8)
    with pytest.raises(JfireError, match="is malformed"):
        lockstep_wire.decode(payload, "k")


FOLLOWER = """
import json, os, sys, time
from jfire import deployment_secret, lockstep
from jfire.disagg import cluster
from jfire.errors import JfireError

role, coordinator = sys.argv[1], sys.argv[2]
me = 0 if role == "leader" else 1
store = lockstep.join(coordinator, 2, me, deployment_secret.from_env())
channel = lockstep.StepChannel("g", [0, 1], me, store)
if role == "leader":
    import numpy as np
    channel.send("decode", (2,), (np.arange(2, dtype=np.int32), {"a": [1, None]}))
    # A stranger with the store's port: a pickle in the next step's key, unsigned.
    store.client.key_value_set_bytes("jfire/lockstep/g/1/2", bytes.fromhex(sys.argv[3]))
    time.sleep(120)  # hosts the coordinator until the test is done with the follower
kind, key, inputs = channel.receive()
print(json.dumps([kind, list(key), inputs[0].tolist(), inputs[1]]), flush=True)
try:
    channel.receive()
    print("ran the forged call", flush=True)
except JfireError as e:
    print(f"jfire: error: {e}", file=sys.stderr, flush=True)
os._exit(2)
"""


def test_a_pickle_written_into_a_step_key_runs_nothing_on_a_real_cluster(tmp_path):
    """A leader and its follower over jax.distributed (two processes, no model); a stranger's
    pickle in the store under the follower's next step: refused unread, the follower exits 2
    with one line naming the key, and the pickle's code never ran."""
    marker = tmp_path / "ran"
    forged = zlib.compress(pickle.dumps(Bomb(marker))).hex()
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **to_env(SECRET)}
    leader = subprocess.Popen([sys.executable, "-c", FOLLOWER, "leader", coordinator, forged], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        follower = subprocess.run([sys.executable, "-c", FOLLOWER, "follower", coordinator], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=120)
        assert leader.poll() is None, leader.communicate()[1][-3000:]
    finally:
        leader.kill()
        leader.communicate()
    assert json.loads(follower.stdout.splitlines()[0]) == ["decode", [2], [0, 1], {"a": [1, None]}]
    assert follower.returncode == 2, follower.stderr[-2000:]
    errors = [line for line in follower.stderr.splitlines() if line.startswith("jfire: error:")]
    assert errors == ["jfire: error: the cluster store's value under 'jfire/lockstep/g/1/2' is not signed with "
                      "this deployment's secret: refused (a process outside the deployment wrote it, or one "
                      "started with another secret)"]
    assert "ran the forged call" not in follower.stdout
    assert not marker.exists()


def test_a_group_without_the_secret_refuses_to_start():
    """`jfire serve --coordinator` as the launchers start a group, but with no secret in its
    environment: one line that says how to make one, before anything joins or loads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JFIRE_DEPLOYMENT_SECRET")}
    run = subprocess.run([sys.executable, "-m", "jfire.cli", "serve", "--mesh", "tp=2", "--coordinator",
                          f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id", "0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.startswith("jfire: error: a group spanning processes needs the deployment secret")
    assert "secrets.token_hex(32)" in run.stderr and "$JFIRE_DEPLOYMENT_SECRET_FILE" in run.stderr
    assert len(run.stderr.splitlines()) == 1
