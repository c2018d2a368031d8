"""Deployment files, routing, and the multi-host launchers (dry runs: the exact commands)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jfire.disagg.deployment import Deployment
from jfire.disagg.frontend import RemoteEngine
from jfire.disagg.launch import Options, process_argv, process_env
from jfire.disagg.prefix_index import PrefixIndex
from jfire.errors import JfireError
from tests.disagg.clients import key_for

REPO = Path(__file__).resolve().parents[2]


def test_local_1p1d_process_table():
    d = Deployment.load("local-1p1d")
    assert [(p.process_id, p.label, p.devices) for p in d.processes] == [
        (0, "frontend", 1), (1, "prefill-0/0", 1), (2, "decode-0/0", 1)]
    assert d.transfer_timeout_s == 30 and d.coordinator_port == 0
    mixed = Deployment.load(str(REPO / "meshes" / "local-1p1d-mixed.toml"))
    assert (mixed.group("prefill-0").mesh.tp, mixed.group("decode-0").mesh.pp) == (3, 2)
    # Each local process is given its own number of host devices; the frontend stays on the CPU.
    envs = [process_env(p, {"XLA_FLAGS": "--xla_foo --xla_force_host_platform_device_count=8"}) for p in mixed.processes]
    assert [e["XLA_FLAGS"] for e in envs] == ["--xla_foo --xla_force_host_platform_device_count=1",
                                             "--xla_foo --xla_force_host_platform_device_count=3",
                                             "--xla_foo --xla_force_host_platform_device_count=2"]
    assert envs[0]["JAX_PLATFORMS"] == "cpu" and "JAX_PLATFORMS" not in envs[1]


@pytest.mark.parametrize("body, message", [
    ('[[groups]]\nname = "p"\nrole = "prefill"\n', "has no decode group"),
    ('[[groups]]\nrole = "prefil"\n', "role must be one of prefill, decode, got 'prefil'"),
    ('[[groups]]\nrole = "prefill"\nmesh = "tp=2"\ndevices_per_process = 1\n'
     '[[groups]]\nrole = "decode"\n', "needs 2 devices but the group has 1 x 1; raise devices_per_process to 2"),
    ('[[groups]]\nrole = "prefill"\nmesh = "tp=4"\nprocesses = 2\n[[groups]]\nrole = "decode"\n',
     "has 4 devices but the group's processes hold 2 x 4 = 8; a group spanning processes runs its mesh over all of "
     "them: set devices_per_process = 2"),
    ('[[groups]]\nrole = "prefill"\nprocesses = 0\n[[groups]]\nrole = "decode"\n', "processes must be >= 1"),
    ('[[groups]]\nrole = "prefill"\ncolour = 1\n[[groups]]\nrole = "decode"\n', "unknown keys ['colour']"),
    ('[[groups]]\nname = "a"\nrole = "prefill"\n[[groups]]\nname = "a"\nrole = "decode"\n', "must be unique"),
    ("name = 'x'\n", "needs [[groups]] tables"),
    ('[transfer]\ncompress = "yes"\n[[groups]]\nrole = "prefill"\n[[groups]]\nrole = "decode"\n',
     "[transfer]: compress must be true or false, got 'yes'"),
    ('[transfer]\ncompress = true\n[[groups]]\nname = "p"\nrole = "prefill"\nmesh = "tp=2"\nprocesses = 2\n'
     'devices_per_process = 1\n[[groups]]\nrole = "decode"\n',
     "group(s) p span processes and send it in blocks, uncoded: set compress = false"),
    ("[[groups]\n", "is not valid TOML"),
])
def test_bad_deployment_files_say_what_is_wrong(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(JfireError, match=None) as e:
        Deployment.load(str(path))
    assert message in str(e.value)


def test_unknown_deployment_lists_the_known_ones():
    with pytest.raises(JfireError) as e:
        Deployment.load("no-such-deployment")
    assert "local-1p1d" in str(e.value) and "cpu-pp2-tp4" not in str(e.value)  # mesh files are not deployments


def test_jfire_launch_refuses_bad_arguments_cleanly():
    r = subprocess.run([sys.executable, "-m", "jfire.cli", "launch", "local-1p1d", "--process-id", "1"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "needs --coordinator HOST:PORT" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "jfire.cli", "launch", "local-1p1d", "--process-id", "7",
                        "--coordinator", "127.0.0.1:1"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "has processes 0..2; got --process-id 7" in r.stderr


class _Group:
    def __init__(self, name, role, alive=True, in_flight=0, info=None):
        self.name, self.role, self.alive, self.in_flight, self.stats = name, role, alive, in_flight, {}
        self.info = info or {}


def _router(groups, prefix_index=None):
    engine = RemoteEngine.__new__(RemoteEngine)
    engine.groups = {g.name: g for g in groups}
    engine.prefix_index, engine._counts, engine._prefilling = prefix_index, collections.Counter(), {}
    return engine


def test_routing_by_affinity_and_load():
    p0, p1, p2 = _Group("prefill-0", "prefill"), _Group("prefill-1", "prefill"), _Group("prefill-2", "prefill")
    d0, d1 = _Group("decode-0", "decode", in_flight=3), _Group("decode-1", "decode", in_flight=1)
    router = _router([p0, p1, p2, d0, d1])
    # The same session key always reaches the same prefill group (its prefix cache), and
    # different keys spread over all of them.
    picks = {key: router._pick("prefill", key).name for key in (f"conversation-{i}" for i in range(60))}
    assert all(router._pick("prefill", key).name == name for key, name in picks.items())
    assert set(picks.values()) == {"prefill-0", "prefill-1", "prefill-2"}
    # Without a key: the least loaded group.
    p0.in_flight, p1.in_flight, p2.in_flight = 2, 0, 5
    assert router._pick("prefill", None) is p1 and router._pick("decode", None) is d1
    # A dead group is skipped; with none left, a clear error.
    d1.alive = False
    assert router._pick("decode", None) is d0
    d0.alive = False
    with pytest.raises(JfireError, match="no decode group is up"):
        router._pick("decode", None)


# The launchers' environment without the operator's secrets (each dry run then shows a fresh
# deployment secret and no API key).
LAUNCHER_ENV = {k: v for k, v in os.environ.items()
                if k not in ("JFIRE_API_KEY", "JFIRE_DEPLOYMENT_SECRET", "JFIRE_DEPLOYMENT_SECRET_FILE")}
# What every process's remote command begins with: the path of this launch's secret file.
SECRET = 'JFIRE_DEPLOYMENT_SECRET_FILE="$HOME"/.jfire/launch-ID/deployment-secret '


def ssh_dry_run(tmp_path: Path, *args: str) -> tuple[list[str], list[str]]:
    """The SSH launcher's dry run: the secret writers' lines and the processes' lines, this
    launch's random folder name read as launch-ID. (An `ssh` that only fails comes first on
    PATH: a dry run that ran anything could never reach a host.)"""
    no_ssh = tmp_path / "no_ssh"
    no_ssh.mkdir()
    (no_ssh / "ssh").write_text("#!/bin/sh\necho \"ssh called in a dry run: $*\" >&2\nexit 99\n")
    (no_ssh / "ssh").chmod(0o755)
    env = {**LAUNCHER_ENV, "PATH": f"{no_ssh}:{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, "scripts/launch_ssh.py", "--dry-run", *args], capture_output=True, text=True,
                       cwd=REPO, env=env, check=True)
    lines = re.sub(r"launch-[0-9a-f]{16}", "launch-ID", r.stdout).splitlines()
    processes = lines.index("# the processes:")
    return [line for line in lines[:processes] if not line.startswith("#")], lines[processes + 1:]


def test_ssh_launcher_dry_run(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-node-1  # head\n\ngpu-node-2\n")
    writers, processes = ssh_dry_run(tmp_path, str(hosts), "local-1p1d", "--workdir", "/srv/jfire", "--model",
                                     "/models/llama")
    assert writers == [
        f"ssh -- gpu-node-{i} 'umask 077 && d=\"$HOME\"/.jfire/launch-ID && mkdir -p -- \"$HOME\"/.jfire && "
        "{ mkdir -- \"$d\" 2>/dev/null; [ -d \"$d\" ] && [ ! -L \"$d\" ] && [ -O \"$d\" ]; } && "
        "cat > \"$d\"/deployment-secret'" for i in (1, 2)]
    assert processes == [
        f"ssh -tt -- gpu-node-1 'cd /srv/jfire && {SECRET}JAX_PLATFORMS=cpu exec .venv/bin/jfire launch local-1p1d "
        "--process-id 0 --coordinator gpu-node-1:8476 --host 0.0.0.0 --model /models/llama'",
        f"ssh -tt -- gpu-node-1 'cd /srv/jfire && {SECRET}exec .venv/bin/jfire launch local-1p1d "
        "--process-id 1 --coordinator gpu-node-1:8476 --host 0.0.0.0 --model /models/llama'",
        f"ssh -tt -- gpu-node-2 'cd /srv/jfire && {SECRET}exec .venv/bin/jfire launch local-1p1d "
        "--process-id 2 --coordinator gpu-node-1:8476 --host 0.0.0.0 --model /models/llama'",
    ]


def test_slurm_launcher_dry_run():
    env = {**LAUNCHER_ENV, "SLURM_JOB_NODELIST": "gpu-node-1,gpu-node-2", "SLURM_JOB_NUM_NODES": "2",
           "JFIRE_DRY_RUN": "1", "JFIRE_PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    r = subprocess.run(["bash", "scripts/launch_slurm.sbatch", "local-1p1d", "--model", "/models/llama"],
                       capture_output=True, text=True, cwd=REPO, env=env, check=True)
    task = ".venv/bin/jfire launch local-1p1d --process-id {} --coordinator gpu-node-1:8476 --host 0.0.0.0 " \
           "--model /models/llama"
    lines = r.stdout.splitlines()
    assert lines[0] == "# deployment secret: made for this job, in the tasks' environment"
    assert lines[1].startswith("srun --ntasks=3 --nodes=2 --distribution=block --kill-on-bad-exit=0 bash -c ")
    assert '"$SLURM_PROCID" = 0' in lines[1] and "JAX_PLATFORMS=cpu" in lines[1]
    assert lines[1].endswith(" jfire-task local-1p1d --coordinator gpu-node-1:8476 --host 0.0.0.0 "
                             "--model /models/llama")
    assert lines[2:] == [f"task {i}: " + task.format(i) for i in range(3)]


def test_local_launch_runs_each_process_with_the_same_options():
    argv = process_argv("local-1p1d", 2, "127.0.0.1:9", Options(model="/m", port=8001, engine_args=("--max-batch", "4")))
    assert argv == ["launch", "local-1p1d", "--process-id", "2", "--coordinator", "127.0.0.1:9", "--model", "/m",
                    "--dtype", "float32", "--host", "127.0.0.1", "--shutdown-grace", "30", "--port", "8001",
                    "--max-batch", "4"]


def test_a_group_that_cannot_start_fails_the_launch_with_its_reason(tmp_path, tiny_hf_dir):
    """A model whose config promises a wider MLP than its weights hold passes the launcher's
    own check (the config reads, the meshes fit), then every group process refuses it as it
    reads the weights: the launch stops every process and exits instead of waiting for groups
    that never come."""
    import json
    import shutil

    model = tmp_path / "mismatched"
    shutil.copytree(tiny_hf_dir("llama2"), model)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] += 8
    (model / "config.json").write_text(json.dumps(config))
    from jfire.disagg.launch import free_port

    r = subprocess.run([sys.executable, "-m", "jfire.cli", "launch", "local-1p1d", "--model", str(model),
                        "--port", str(free_port())], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "has shape" in r.stderr and "but the config implies" in r.stderr
    assert "a process exited; see its error above. All processes stopped." in r.stderr


def test_a_group_mesh_the_model_cannot_take_is_refused_before_any_process_starts(tmp_path):
    """tp=2 does not divide the default model's 9 heads: one line and exit status 2 from the
    launcher, which started nothing."""
    path = tmp_path / "bad-mesh.toml"
    path.write_text((REPO / "meshes" / "local-1p1d.toml").read_text().replace(
        'role = "prefill"\nmesh = "single"\ndevices_per_process = 1', 'role = "prefill"\nmesh = "tp=2"\n'
        'devices_per_process = 2'))
    from jfire.disagg.launch import free_port

    r = subprocess.run([sys.executable, "-m", "jfire.cli", "launch", str(path), "--port", str(free_port())],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines() == [
        "jfire: error: group 'prefill-0' of deployment 'local-1p1d': mesh 'tp=2' does not fit: tp=2 does not divide "
        "the 9 attention heads; tp=2 and the 3 KV heads do not divide one another. Would fit: pp=1,tp=1, pp=2,tp=1"]


def test_ssh_launcher_dry_run_of_a_group_spanning_hosts(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-node-1\ngpu-node-2\n")
    _, processes = ssh_dry_run(tmp_path, str(hosts), "--group", "--workdir", "/srv/jfire", "--model", "/models/llama",
                               "--", "--mesh", "pp=2,tp=8")
    assert processes == [
        f"ssh -tt -- gpu-node-{i + 1} 'cd /srv/jfire && {SECRET}exec .venv/bin/jfire serve --model /models/llama "
        f"--coordinator gpu-node-1:8476 --num-processes 2 --process-id {i} --host 0.0.0.0 --mesh pp=2,tp=8'"
        for i in range(2)]
    refused = subprocess.run([sys.executable, "scripts/launch_ssh.py", str(hosts), "--group", "--dry-run"],
                             capture_output=True, text=True, cwd=REPO)
    assert refused.returncode == 2 and "--group needs the engine's mesh" in refused.stderr


def test_slurm_launcher_dry_run_of_a_group_spanning_nodes():
    env = {**LAUNCHER_ENV, "SLURM_JOB_NODELIST": "gpu-node-1,gpu-node-2", "SLURM_JOB_NUM_NODES": "2",
           "JFIRE_DRY_RUN": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(["bash", "scripts/launch_slurm.sbatch", "--group", "--mesh", "pp=2,tp=8", "--model",
                        "/models/llama"], capture_output=True, text=True, cwd=REPO, env=env, check=True)
    lines = r.stdout.splitlines()
    assert lines[1].startswith("srun --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c ")
    task = ".venv/bin/jfire serve --coordinator gpu-node-1:8476 --num-processes 2 --process-id {} --host 0.0.0.0 " \
           "--mesh pp=2,tp=8 --model /models/llama"
    assert lines[2:] == [f"task {i}: " + task.format(i) for i in range(2)]


def test_launchers_dry_run_of_groups_spanning_two_hosts(tmp_path):
    """local-groups-2x2 on 2 hosts: 5 processes in blocks, the frontend and the prefill group's
    2 processes on the first host, the decode group's 2 on the second."""
    from jfire.disagg.deployment import Deployment

    deployment = Deployment.load("local-groups-2x2")
    assert [(p.label, p.devices) for p in deployment.processes] == [
        ("frontend", 1), ("prefill-0/0", 3), ("prefill-0/1", 3), ("decode-0/0", 1), ("decode-0/1", 1)]
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-node-1\ngpu-node-2\n")
    _, processes = ssh_dry_run(tmp_path, str(hosts), "local-groups-2x2", "--workdir", "/srv/jfire")
    assert processes == [
        f"ssh -tt -- gpu-node-{host} 'cd /srv/jfire && {SECRET}{env}exec .venv/bin/jfire launch local-groups-2x2 "
        f"--process-id {i} --coordinator gpu-node-1:8476 --host 0.0.0.0 --model default'"
        for i, (host, env) in enumerate([(1, "JAX_PLATFORMS=cpu "), (1, ""), (1, ""), (2, ""), (2, "")])]
    env = {**LAUNCHER_ENV, "SLURM_JOB_NODELIST": "gpu-node-1,gpu-node-2", "SLURM_JOB_NUM_NODES": "2",
           "JFIRE_DRY_RUN": "1", "JFIRE_PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    r = subprocess.run(["bash", "scripts/launch_slurm.sbatch", "local-groups-2x2"], capture_output=True, text=True,
                       cwd=REPO, env=env, check=True)
    lines = r.stdout.splitlines()
    assert lines[1].startswith("srun --ntasks=5 --nodes=2 --distribution=block ")
    assert lines[2:] == [f"task {i}: .venv/bin/jfire launch local-groups-2x2 --process-id {i} --coordinator "
                         "gpu-node-1:8476 --host 0.0.0.0" for i in range(5)]


def test_a_launch_gives_its_groups_the_engine_settings_it_was_given(monkeypatch):
    """Each group process parses the arguments the launcher hands it: its engine must be set up
    as the command line asked (switches such as --quick-compile included), not with defaults."""
    from jfire import cli
    from jfire.disagg import launch

    seen = {}

    def launch_local(deployment, deployment_arg, options, secret):  # records what each process would be given
        seen["options"] = options
        return 0

    monkeypatch.setattr(launch, "launch_local", launch_local)
    asked = ["launch", "local-1p1d", "--max-batch", "4", "--kv-cache-gb", "0.05", "--prefill-budget", "32",
             "--max-context", "128", "--no-run-ahead", "--no-cpu-matmul", "--quick-compile", "--compile-cache", "off"]
    assert cli.main(asked) == 0
    group = process_argv("local-1p1d", 1, "127.0.0.1:9", seen["options"])
    parser = cli.build_parser()
    assert cli.engine_config(parser.parse_args(group), single=False) == cli.engine_config(parser.parse_args(asked),
                                                                                           single=False)
    assert cli.engine_config(parser.parse_args(group), single=False).quick_compile


def test_routing_by_prefix_weighs_the_blocks_to_compute_against_the_queue():
    """SGLang's and Dynamo's cache-aware routing: the frontend's index of what it sent where
    (jfire.disagg.prefix_index), bounded per group by the blocks its caches hold."""
    index = PrefixIndex(page_size=4)
    p0, p1 = _Group("prefill-0", "prefill"), _Group("prefill-1", "prefill")
    router = _router([p0, p1, _Group("decode-0", "decode")], index)
    system = list(range(1000, 1040))  # 10 blocks every session shares
    session_a, session_b = system + list(range(100)), system + list(range(100, 200))  # 25 blocks of their own
    # Nothing known: session affinity, then load.
    assert router._pick("prefill", "a", index.hashes(session_a)).name == router._pick("prefill", "a").name
    index.record("prefill-0", index.hashes(session_a))
    index.record("prefill-1", index.hashes(session_b))
    # A's next turn goes where A's history is, whatever its affinity key says, and B's to B's.
    assert router._pick("prefill", "b", index.hashes(session_a + [7] * 8)) is p0
    assert router._pick("prefill", "a", index.hashes(session_b + [7] * 8)) is p1
    # A new session shares only the system prompt, which both hold: affinity and load decide.
    newcomer = index.hashes(system + list(range(500, 540)))
    p0.in_flight = 3
    assert router._pick("prefill", None, newcomer) is p1
    # A holder busy prefilling others loses to an idle group once its queue outweighs the
    # blocks it would save (25 here, PREFIX_LOAD_BLOCKS a prompt in its queue).
    router._prefilling = {f"r{i}": p0 for i in range(2)}
    assert router._pick("prefill", None, index.hashes(session_a + [7] * 8)) is p1
    router._prefilling = {}
    assert router._counts["routed_by_prefix"] >= 1 and router._counts["routed_by_load"] == 1
    # A session key outweighs a few blocks of difference (a system prompt one group saw first).
    index.record("prefill-0", index.hashes(system + [9] * 8))
    router._counts.clear()
    assert router._pick("prefill", key_for(1), index.hashes(system + [9] * 8 + [5] * 40)) is p1
    assert router._counts == {"routed_by_affinity": 1}
    # A group that goes down loses its entries; capacity keeps the most recently used blocks.
    index.forget("prefill-0")
    assert index.matched("prefill-0", index.hashes(session_a)) == 0
    index.set_capacity("prefill-1", 12)
    assert index.blocks("prefill-1") == 12
    assert index.matched("prefill-1", index.hashes(session_b)) == 0  # its leading blocks went first


def test_a_group_chosen_for_load_fetches_the_prefix_another_holds():
    """The shared prefix store (jfire.disagg.prefix_store): the frontend names the group of the
    same KV layout thought to hold the most of the prompt, and the blocks to fetch from it."""
    shares = {"shares_prefixes": True, "kv_layout": "float32 x 2 arrays"}
    index = PrefixIndex(page_size=4)
    p0 = _Group("prefill-0", "prefill", info={**shares, "control": "http://p0"})
    p1 = _Group("prefill-1", "prefill", info={**shares, "control": "http://p1"})
    router = _router([p0, p1, _Group("decode-0", "decode")], index)
    prompt = index.hashes(list(range(80)))  # 20 blocks
    index.record("prefill-0", prompt[:16])
    index.record("prefill-1", prompt[:4])
    assert router._prefix_source(p1, prompt) == {"group": "prefill-0", "first": 4, "blocks": 16}
    assert router._prefix_source(p0, prompt) is None  # nobody holds more than it does
    # Not from a group that is down, shares nothing, or lays its KV out otherwise.
    for change in ({"alive": False}, {"info": {**p0.info, "shares_prefixes": False}},
                   {"info": {**p0.info, "kv_layout": "float32 x 2 arrays, 2 shards"}}):
        saved = dict(vars(p0))
        vars(p0).update(change)
        assert router._prefix_source(p1, prompt) is None, change
        vars(p0).update(saved)
    assert router._counts["prefix_fetches"] == 1
