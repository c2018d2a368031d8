"""The deployment's cluster (jfire.disagg.cluster) as a stranger on the network meets it: the
coordinator listens on the address it was given only, every value jfire reads from the store
must be signed with the deployment secret, what the engine thread polls cannot fail it, and no
process of a deployment starts without the secret (a local launch makes one per launch and
hands it to its processes in their environment, never their arguments)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jfire import lockstep
from jfire.deployment_secret import ENV, FILE_ENV, DeploymentSecret, to_env, write_file
from jfire.disagg import cluster, launch
from jfire.disagg.launch import free_port
from jfire.disagg.signed_store import SignedStore
from jfire.errors import JfireError
from tests import listening_sockets
from tests.memory_store import MemoryClient

REPO = Path(__file__).resolve().parents[2]
SECRET = DeploymentSecret(bytes(range(32)))

JOIN = """
import sys, time
from jfire import deployment_secret
from jfire.disagg import cluster

cluster.join(sys.argv[1], 2, int(sys.argv[2]), secret=deployment_secret.from_env(), init_timeout_s=60)
print("joined", flush=True)
time.sleep(120)
"""


def listening(pid: int) -> set[str]:
    """The addresses a process listens on, less the ports."""
    return {address for address, _ in listening_sockets.listening(pid)}


def test_the_coordinator_listens_only_on_the_address_it_was_given():
    """Process 0 of a two-process cluster given 127.0.0.1: nothing it listens on is reachable
    from any other address (JAX's own default is [::], every interface)."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **to_env(SECRET)}
    env.pop("JAX_COORDINATOR_BIND_ADDRESS", None)
    procs = [subprocess.Popen([sys.executable, "-c", JOIN, coordinator, str(i)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "joined", p.communicate(timeout=5)[1][-2000:] if p.poll() else ""
        addresses = listening(procs[0].pid)
        assert addresses and addresses == {"127.0.0.1"}, addresses
        port = int(coordinator.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it is the coordinator's port that was read
    finally:
        for p in reversed(procs):
            p.kill()
            p.communicate()


def test_a_host_name_binds_what_it_names_and_the_operator_may_say_otherwise(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert cluster.bind_address("127.0.0.1:8476") == "127.0.0.1:8476"
    assert cluster.bind_address("[::1]:8476") == "[::1]:8476"
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "127.0.0.1:9000")
    assert cluster.bind_address("node-1:8476") == "127.0.0.1:9000"


# -- the signed store ------------------------------------------------------------------------


def stores():
    client = MemoryClient()
    return client, SignedStore(client, SECRET)


def test_values_round_trip_signed_and_a_strangers_are_refused_by_key():
    client, store = stores()
    store.key_value_set("jfire/groups/p0", json.dumps({"role": "prefill"}))
    store.key_value_set_bytes("/jfire//x/", b"\x00\xffraw")  # signed as the store keeps the key
    assert cluster.wait_group(store, "p0", 1) == {"role": "prefill"}
    assert store.key_value_try_get_bytes("jfire/x") == b"\x00\xffraw"
    assert client.values["jfire/groups/p0"].endswith(b'{"role": "prefill"}')  # signed, not hidden
    client.key_value_set("jfire/groups/d0", json.dumps({"role": "decode", "control": "http://127.0.0.1:1"}))
    with pytest.raises(JfireError, match="under 'jfire/groups/d0' is not signed with this deployment's secret"):
        cluster.wait_group(store, "d0", 1)
    with pytest.raises(JfireError, match="'jfire/groups/p0' is not signed"):  # another deployment's secret
        SignedStore(client, DeploymentSecret(b"\x09" * 32)).key_value_try_get("jfire/groups/p0")
    # A value moved under another key does not verify there.
    client.values["jfire/groups/d0"] = client.values["jfire/groups/p0"]
    with pytest.raises(JfireError, match="'jfire/groups/d0' is not signed"):
        store.key_value_try_get("jfire/groups/d0")


def test_a_forged_registration_redirects_no_frontend(capsys):
    """The frontend's poll for a restarted group's registration: a stranger's is ignored, with
    a line saying so; an authentic one that is no registration fails its wait by name."""
    client, store = stores()
    client.key_value_set("jfire/groups/d0", json.dumps({"control": "http://attacker.example"}))
    assert cluster.read_group(store, "d0") is None
    assert "'jfire/groups/d0' is not signed" in capsys.readouterr().err
    store.key_value_set("jfire/groups/d0", "[1, 2]", allow_overwrite=True)
    with pytest.raises(JfireError, match="under 'jfire/groups/d0' is not a group's registration"):
        cluster.wait_group(store, "d0", 1)


def test_what_the_engine_thread_polls_cannot_fail_it(capsys):
    """Acks and abandon notes: a stranger's value, text that is not UTF-8, a key naming no
    transfer, an authentic ack of the wrong form: each dropped (and deleted) with a warning;
    the good ones taken. (An abandon note's shape is checked by the connector reading it.)"""
    client, store = stores()
    store.key_value_set(cluster.ack_key("p0", 11), cluster.PULLED)
    store.key_value_set(cluster.ack_key("p0", 12), "maybe")
    store.key_value_set(cluster.ack_key("p0", "x"), cluster.DROPPED)
    client.key_value_set(cluster.ack_key("p0", 13), cluster.DROPPED)  # unsigned
    client.key_value_set_bytes(cluster.ack_key("p0", 14), b"\xff\xfe")  # unsigned, not text
    assert cluster.take_all(store, cluster.ack_key("p0", "")) == [(11, cluster.PULLED)]
    assert client.values == {}
    note = json.dumps({"num_pages": 3, "shards": 1, "codec": None})
    store.key_value_set(cluster.abandon_key("p0", 21), note)
    client.key_value_set(cluster.abandon_key("p0", 22), note)  # unsigned
    assert cluster.take_all(store, cluster.abandon_key("p0", "")) == [(21, note)]
    assert client.values == {}
    assert "ignored malformed or unsigned store keys" in capsys.readouterr().err


def test_counters_are_read_as_plain_counts_only():
    """Signs of life are the coordinator's counters (untagged): read as a count, or as none."""
    client, store = stores()
    channel = lockstep.StepChannel("g", [0, 1], 0, store)
    assert channel._read_beat(1) is None
    store.key_value_increment("jfire/lockstep/g/beat/1", 1)
    store.key_value_increment("jfire/lockstep/g/beat/1", 1)
    assert channel._read_beat(1) == 2
    for junk in (b"", b"-1", b"1e9", b"\xff", b"9" * 40, b"12 "):
        client.values["jfire/lockstep/g/beat/1"] = junk
        assert channel._read_beat(1) is None


def test_gloo_keys_are_forgotten_by_name_without_being_read():
    client, store = stores()
    client.key_value_set_bytes("cpu:gloo/0,1/rendezvous", b"\x00gloo's own")
    client.key_value_set_bytes("cpu:gloo/4,5/rendezvous", b"\x00another group's")
    assert cluster.forget_collectives(store, {0, 1}) == 1
    assert list(client.values) == ["cpu:gloo/4,5/rendezvous"]


# -- the secret's way to every process -------------------------------------------------------


def no_secret_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in (ENV, FILE_ENV)}


def test_a_process_of_a_deployment_refuses_to_start_without_the_secret():
    """What the SSH and Slurm launchers start on each host: with no secret, one line saying how
    to make one and where it is looked for; nothing joins."""
    run = subprocess.run([sys.executable, "-m", "jfire.cli", "launch", "local-1p1d", "--process-id", "1",
                          "--coordinator", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, cwd=REPO,
                         env=no_secret_env(), timeout=60)
    assert run.returncode == 2
    assert run.stderr.startswith("jfire: error: process 1 of deployment 'local-1p1d' needs the deployment secret")
    assert "secrets.token_hex(32)" in run.stderr and f"${FILE_ENV}" in run.stderr and f"${ENV}" in run.stderr
    assert len(run.stderr.splitlines()) == 1


class Started(Exception):
    pass


def launch_children(monkeypatch, environ: dict) -> list[tuple[list[str], dict]]:
    """`jfire launch local-1p1d` run until it starts its first process (recorded, not started)."""
    from jfire import cli, device_memory

    started = []

    def popen(argv, env, **_):
        started.append((argv, env))
        raise Started

    monkeypatch.setattr(device_memory, "use_plan_allocator", lambda: {})
    monkeypatch.setattr(launch, "check_model", lambda deployment, model: Path("/models/m"))
    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    for key in (ENV, FILE_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(Started):
        cli.main(["launch", "local-1p1d"])
    return started


def test_a_local_launch_hands_its_processes_one_secret_in_their_environment(monkeypatch, tmp_path):
    first = launch_children(monkeypatch, {})
    second = launch_children(monkeypatch, {})
    (argv, env), (_, env2) = first[0], second[0]
    made = DeploymentSecret.from_hex(env[ENV], ENV)  # a whole secret
    assert env2[ENV] != made.hex()  # one per launch
    assert made.hex() not in " ".join(argv)
    # The operator's, from a file: every process gets that one.
    path = tmp_path / "secret"
    write_file(path, SECRET)
    (argv, env), = launch_children(monkeypatch, {FILE_ENV: str(path)})
    assert env[ENV] == SECRET.hex() and SECRET.hex() not in " ".join(argv)


def test_a_launch_refuses_a_secret_file_others_can_read(tmp_path):
    path = tmp_path / "secret"
    write_file(path, SECRET)
    path.chmod(0o644)
    run = subprocess.run([sys.executable, "-m", "jfire.cli", "launch", "local-1p1d", "--process-id", "1",
                          "--coordinator", "127.0.0.1:1"], capture_output=True, text=True, cwd=REPO,
                         env={**no_secret_env(), FILE_ENV: str(path)}, timeout=60)
    assert run.returncode == 2 and f"chmod 600 {path}" in run.stderr and "Traceback" not in run.stderr


def test_the_socket_reader_sees_a_listener():
    """(The coordinator's check above reads real sockets: this one it must see.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert "127.0.0.1" in listening(os.getpid())
