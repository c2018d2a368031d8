"""The multi-host launchers run for real against stand-ins: a fake `srun` that runs each task
here with its SLURM_PROCID, a fake `ssh` that runs the remote command here in bash (as sshd
would), and a fake `.venv/bin/jfire` that writes down what it was given. Nothing reaches
another host. What they must show: every argument arrives whole and is never run as shell
code, a host-file line is never an ssh option, and no secret is ever on a command line."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from jfire.deployment_secret import DeploymentSecret, write_file
from jfire.errors import JfireError

REPO = Path(__file__).resolve().parents[2]
# Left out of the launchers' environment: the operator's secrets, and what the frontend's task sets itself.
LEFT_OUT = ("JFIRE_API_KEY", "JFIRE_DEPLOYMENT_SECRET", "JFIRE_DEPLOYMENT_SECRET_FILE", "JAX_PLATFORMS")

# Writes down its argv, the secrets it can see and the files they name, one JSON file a run.
FAKE_JFIRE = """#!{python}
import json, os, sys, tempfile
secret_file = os.environ.get("JFIRE_DEPLOYMENT_SECRET_FILE")
argv = sys.argv[1:]
key_file = argv[argv.index("--api-key-file") + 1] if "--api-key-file" in argv else None
seen = {{
    "argv": argv,
    "procid": os.environ.get("SLURM_PROCID"),
    "jax_platforms": os.environ.get("JAX_PLATFORMS"),
    "secret": os.environ.get("JFIRE_DEPLOYMENT_SECRET"),
    "secret_file": secret_file,
    "file_mode": secret_file and oct(os.stat(secret_file).st_mode & 0o777),
    "folder_mode": secret_file and oct(os.stat(os.path.dirname(secret_file)).st_mode & 0o777),
    "file_secret": secret_file and open(secret_file).read().strip(),
    "api_key": key_file and open(key_file).read(),
    "api_key_mode": key_file and oct(os.stat(key_file).st_mode & 0o777),
}}
fd, path = tempfile.mkstemp(dir=os.environ["RECORD"], prefix="jfire-", suffix=".json")
os.write(fd, json.dumps(seen).encode())
"""

# Slurm's srun, as far as these scripts use it: skip the options, run the task once per process.
FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$RECORD/srun.argv"
n=1
while [[ $1 == --* ]]; do
    if [[ $1 == --ntasks=* ]]; then n=${1#--ntasks=}; fi
    shift
done
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i "$@" || exit $?; done
"""

# ssh: writes down its argv, then runs the command after `--` and the host in bash, here, in
# the "remote" home, with none of the caller's environment (ssh forwards none of it).
FAKE_SSH = """#!/bin/bash
printf '%s\\0' "$@" > "$(mktemp "$RECORD/ssh-XXXXXX")"
while [ $# -gt 0 ] && [ "$1" != -- ]; do shift; done
if [ $# -ne 3 ]; then echo "fake ssh: not OPTIONS -- HOST COMMAND" >&2; exit 97; fi
exec env -i HOME="$REMOTE_HOME" PATH="$PATH" RECORD="$RECORD" bash -c "$3"
"""


@pytest.fixture
def rig(tmp_path):
    """A working directory holding the fake jfire, a bin/ of fake srun and ssh, a record folder."""
    work, bin_dir, record, home = (tmp_path / d for d in ("work", "bin", "record", "home"))
    for d in (work / ".venv" / "bin", bin_dir, record, home):
        d.mkdir(parents=True)
    for path, text in [(work / ".venv" / "bin" / "jfire", FAKE_JFIRE.format(python=sys.executable)),
                       (bin_dir / "srun", FAKE_SRUN), (bin_dir / "ssh", FAKE_SSH)]:
        path.write_text(text)
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in LEFT_OUT}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", RECORD=str(record), REMOTE_HOME=str(home), JFIRE_PYTHON=sys.executable,
               SLURM_JOB_NODELIST="gpu-node-1,gpu-node-2", SLURM_JOB_NUM_NODES="2")
    return work, record, home, env


def seen_by_jfire(record: Path) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in record.glob("jfire-*.json")]
    return sorted(runs, key=lambda r: int(r["argv"][r["argv"].index("--process-id") + 1]))


def argvs(record: Path, prefix: str) -> list[list[str]]:
    return [p.read_bytes().decode().split("\0")[:-1] for p in sorted(record.glob(prefix + "*"))]


HOSTILE_ARGS = ["--model", "/models/my llama", "--served-model-name", "$(touch {marker}) `touch {marker}` it's"]


def _hostile(marker: Path) -> list[str]:
    return [a.format(marker=marker) for a in HOSTILE_ARGS]


@pytest.mark.parametrize("group", [False, True], ids=["deployment", "group"])
def test_slurm_tasks_get_every_argument_whole_and_run_none_of_it(rig, tmp_path, group):
    work, record, _, env = rig
    marker = tmp_path / "MARKER"
    head = ["--group", "--mesh", "pp=2"] if group else ["local-1p1d"]
    r = subprocess.run(["bash", str(REPO / "scripts" / "launch_slurm.sbatch"), *head, *_hostile(marker)],
                       cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    runs = seen_by_jfire(record)
    assert len(runs) == (2 if group else 3)
    for i, run in enumerate(runs):
        if group:
            want = ["serve", "--coordinator", "gpu-node-1:8476", "--num-processes", "2", "--process-id", str(i),
                    "--host", "0.0.0.0", "--mesh", "pp=2", *_hostile(marker)]
        else:
            want = ["launch", "local-1p1d", "--process-id", str(i), "--coordinator", "gpu-node-1:8476", "--host",
                    "0.0.0.0", *_hostile(marker)]
        assert run["argv"] == want
        assert run["procid"] == str(i)
        assert run["jax_platforms"] == ("cpu" if i == 0 and not group else None)
    # One secret made for the job, in every task's environment and on no command line.
    secret = runs[0]["secret"]
    assert len(bytes.fromhex(secret)) == 32 and all(run["secret"] == secret for run in runs)
    every_argv = [*argvs(record, "srun.argv"), *(run["argv"] for run in runs)]
    assert not any(secret in arg for argv in every_argv for arg in argv)


def test_slurm_tasks_read_the_operators_secret_file_and_refuse_a_key_on_argv(rig, tmp_path):
    work, record, _, env = rig
    secret_file = tmp_path / "shared" / "secret"
    secret_file.parent.mkdir()
    write_file(secret_file, DeploymentSecret.generate())
    env = {**env, "JFIRE_DEPLOYMENT_SECRET_FILE": str(secret_file)}
    script = str(REPO / "scripts" / "launch_slurm.sbatch")
    r = subprocess.run(["bash", script, "local-1p1d"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    runs = seen_by_jfire(record)
    assert [(run["secret"], run["secret_file"]) for run in runs] == [(None, str(secret_file))] * 3
    assert {run["file_secret"] for run in runs} == {secret_file.read_text().strip()}
    (record / "srun.argv").unlink()
    for key in (["--api-key", "k3y"], ["--api-key=k3y"]):
        r = subprocess.run(["bash", script, "local-1p1d", *key], cwd=work, env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "--api-key-file" in r.stderr
        assert not (record / "srun.argv").exists()


HOSTILE_LINES = ["-oProxyCommand=touch${IFS}{marker}", "-oProxyCommand=touch {marker}", "gpu-node-2;touch {marker}",
                 "$(touch {marker})", "`touch {marker}`", "alice@-oProxyCommand=x", "-alice@gpu-node-2",
                 "gpu-node-2 gpu-node-3", "gpu|node", "gpu-node-2>x", "gpu-node-2&", "'gpu-node-2'", "gpu\tnode"]


def _launch_ssh():
    """scripts/launch_ssh.py as a module."""
    spec = importlib.util.spec_from_file_location("launch_ssh", REPO / "scripts" / "launch_ssh.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("line", HOSTILE_LINES[:3])
def test_a_hostile_host_file_line_is_refused_before_anything_runs(rig, tmp_path, line):
    work, record, _, env = rig
    marker = tmp_path / "MARKER"
    hosts = tmp_path / "hosts"
    hosts.write_text(f"# the head node first\ngpu-node-1\n{line.replace('{marker}', str(marker))}\n")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "launch_ssh.py"), str(hosts), "local-1p1d",
                        "--workdir", str(work)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"host file {hosts}, line 3:" in r.stderr and "is not a host" in r.stderr
    assert not list(record.iterdir()) and not marker.exists()


def test_host_file_lines_are_host_names_or_addresses(tmp_path):
    launch_ssh = _launch_ssh()
    hosts = tmp_path / "hosts"
    for line in HOSTILE_LINES:
        hosts.write_text(f"gpu-node-1\n{line}  # a comment\n")
        with pytest.raises(JfireError, match=f"host file {hosts}, line 2: .* is not a host"):
            launch_ssh.read_hosts(str(hosts))
    good = ["gpu-node-1", "alice@gpu-node-2", "node_3.cluster.example", "10.0.0.7", "bob@fd00::7", "::1"]
    hosts.write_text("\n".join(f"{h}   # {i}" for i, h in enumerate(good)) + "\n\n")
    assert launch_ssh.read_hosts(str(hosts)) == good
    # The coordinator is dialled at the host itself, not at the ssh login.
    assert [launch_ssh.coordinator_address(h, 8476) for h in good[1:2] + good[-2:]] == [
        "gpu-node-2:8476", "[fd00::7]:8476", "[::1]:8476"]


def test_ssh_runs_each_process_with_its_arguments_whole_and_the_secret_in_a_file(rig, tmp_path):
    """`ssh -- host 'cmd'` for the secret's writers, `ssh -tt -- host 'cmd'` for the processes;
    each process finds the operator's secret in a 0600 file and the API key (from
    $JFIRE_API_KEY) in another on the first host; neither is on any argv; both are gone after."""
    work, record, home, env = rig
    marker = tmp_path / "MARKER"
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-node-1\nalice@gpu-node-2\n")
    secret = DeploymentSecret.generate()
    env = {**env, "JFIRE_DEPLOYMENT_SECRET": secret.hex(), "JFIRE_API_KEY": "the-api-key"}
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "launch_ssh.py"), str(hosts), "local-1p1d",
                        "--workdir", str(work), "--", *_hostile(marker)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    runs = seen_by_jfire(record)
    assert len(runs) == 3
    for i, run in enumerate(runs):
        key = ["--api-key-file", run["secret_file"].replace("deployment-secret", "api-key")] if i == 0 else []
        assert run["argv"] == ["launch", "local-1p1d", "--process-id", str(i), "--coordinator", "gpu-node-1:8476",
                               "--host", "0.0.0.0", "--model", "default", *_hostile(marker), *key]
        assert run["secret"] is None and run["file_secret"] == secret.hex()
        assert (run["file_mode"], run["folder_mode"]) == ("0o600", "0o700")
        assert Path(run["secret_file"]).parent.parent == home / ".jfire"
    assert (runs[0]["api_key"], runs[0]["api_key_mode"]) == ("the-api-key\n", "0o600")

    calls = argvs(record, "ssh-")
    writers = [c for c in calls if c[0] == "--" and "cat >" in c[2]]
    processes = [c for c in calls if c[0] == "-tt"]
    assert sorted(c[1] for c in writers) == ["alice@gpu-node-2", "gpu-node-1", "gpu-node-1"]
    assert sorted(c[:3] for c in processes) == [["-tt", "--", h] for h in ("alice@gpu-node-2", "gpu-node-1",
                                                                            "gpu-node-1")]
    assert all(len(c) == 4 and c[3].startswith(f"cd {work} && JFIRE_DEPLOYMENT_SECRET_FILE=") for c in processes)
    assert not any(s in arg for c in calls for arg in c for s in (secret.hex(), "the-api-key"))
    assert list((home / ".jfire").iterdir()) == []  # removed when the launch ended


def test_ssh_refuses_an_api_key_on_the_command_line(rig, tmp_path):
    work, record, _, env = rig
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-node-1\n")
    for key in (["--api-key", "k3y"], ["--api-key=k3y"]):
        r = subprocess.run([sys.executable, str(REPO / "scripts" / "launch_ssh.py"), str(hosts), "local-1p1d", "--",
                            *key], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--api-key-file" in r.stderr
    assert not list(record.iterdir())


def test_the_secret_folder_is_private_even_under_a_shared_base(rig, tmp_path):
    """--secret-dir names the base; this launch's folder in it is made 0700 whatever the umask
    of the caller, so a base others can list (/tmp) exposes nothing."""
    work, record, _, env = rig
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-node-1\ngpu-node-2\n")
    base = tmp_path / "shared base"
    base.mkdir()
    base.chmod(0o777)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "launch_ssh.py"), str(hosts), "--group",
                        "--workdir", str(work), "--secret-dir", str(base), "--", "--mesh", "pp=2"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    runs = seen_by_jfire(record)
    assert [Path(run["secret_file"]).parent.parent for run in runs] == [base, base]
    assert {(run["file_mode"], run["folder_mode"]) for run in runs} == {("0o600", "0o700")}
    assert len({run["file_secret"] for run in runs}) == 1 and runs[0]["api_key"] is None
    assert stat.S_IMODE(base.stat().st_mode) == 0o777 and list(base.iterdir()) == []


def test_a_secret_is_never_written_through_a_link_planted_in_a_shared_base(tmp_path):
    """Where the launch's folder is already a link (planted by someone who can write the base),
    the writer fails and writes nothing where the link leads."""
    base, elsewhere = tmp_path / "base", tmp_path / "elsewhere"
    base.mkdir()
    elsewhere.mkdir()
    folder = _launch_ssh().SecretDir.make(str(base))
    (base / folder.name).symlink_to(elsewhere)
    r = subprocess.run(["bash", "-c", folder.writer("deployment-secret")], input="secret\n", text=True)
    assert r.returncode != 0 and list(elsewhere.iterdir()) == []
