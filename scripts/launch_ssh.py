"""Start a deployment on several hosts over SSH: one `jfire launch --process-id` per process.

    .venv/bin/python scripts/launch_ssh.py HOSTFILE DEPLOYMENT [--model M] [--port P]
        [--workdir DIR] [--coordinator-port N] [--secret-dir DIR] [--api-key-file FILE] [--dry-run]
        [-- extra jfire launch options]
    .venv/bin/python scripts/launch_ssh.py HOSTFILE --group [--model M] [--port P] [--workdir DIR]
        [--coordinator-port N] [--secret-dir DIR] [--api-key-file FILE] [--dry-run]
        -- --mesh MESH [extra jfire serve options]

HOSTFILE lists one host per line (# comments): a host name or address, optionally `user@`
before it; anything else (a leading '-', spaces, shell characters) is refused with its line.
Processes go to hosts in contiguous blocks in process order (process 0, the frontend and
coordinator, on the first host), the same mapping Slurm's block distribution gives. Every host
needs this checkout at --workdir (default: the same path as here) with its .venv set up, and
the same deployment file. --dry-run prints the commands instead of running them. Ctrl-C stops
every remote process (ssh -tt forwards it).

--group runs one engine whose mesh spans the hosts instead (`jfire serve --coordinator`): one
process per host, the first host's the leader (it serves HTTP), each host's devices its part
of the mesh.

Secrets never go on a command line, here or on the hosts (`ps` shows argv to every user):
  - The deployment secret every process shares is the operator's ($JFIRE_DEPLOYMENT_SECRET or
    $JFIRE_DEPLOYMENT_SECRET_FILE here) or else a fresh one per launch. Before the processes
    start, one ssh per host writes it from ssh's stdin into a 0600 file in a folder of this
    launch under --secret-dir (default ~/.jfire on each host); each process is told the file's
    path ($JFIRE_DEPLOYMENT_SECRET_FILE). The folder is removed when the launch ends.
  - The API key, from --api-key-file (one key a line) or else $JFIRE_API_KEY here, travels the
    same way to the first host, whose process serves HTTP (`--api-key-file` there). An
    `--api-key-file` among the extra options names a file already on that host instead.
    `--api-key KEY` is refused.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jfire import deployment_secret  # noqa: E402
from jfire.disagg.deployment import DEFAULT_COORDINATOR_PORT, Deployment  # noqa: E402
from jfire.errors import JfireError  # noqa: E402

# A host-file line: [user@]name, the name a host name, an alias or an IPv4/IPv6 address. No
# leading '-' (ssh would read it as an option), no spaces, no shell characters.
_WORD = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
HOST = re.compile(rf"(?:{_WORD}@)?(?:{_WORD}|[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*)")
SECRET_FILE = "deployment-secret"
API_KEY_FILE = "api-key"


def read_hosts(path: str) -> list[str]:
    hosts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        host = line.split("#")[0].strip()
        if host and not HOST.fullmatch(host):
            raise JfireError(
                f"host file {path}, line {number}: {host!r} is not a host: give a host name or address "
                "(letters, digits, '.', '-', '_', ':'), optionally user@ before it, one a line, not starting with '-'"
            )
        if host:
            hosts.append(host)
    if not hosts:
        raise JfireError(f"host file {path} lists no hosts (one per line)")
    return hosts


def coordinator_address(host: str, port: int) -> str:
    """The coordinator's address as the processes dial it: the host without its ssh user, an
    IPv6 address in brackets."""
    name = host.rpartition("@")[2]
    return f"[{name}]:{port}" if ":" in name else f"{name}:{port}"


@dataclass(frozen=True)
class SecretDir:
    """This launch's folder of secret files on every host: `base` (a shell word: "$HOME"/.jfire
    by default, else the quoted path given) / launch-<random>."""

    base: str
    name: str

    @classmethod
    def make(cls, base: str | None) -> SecretDir:
        if base is None or base in ("~", "~/"):
            word = '"$HOME"/.jfire' if base is None else '"$HOME"'
        elif base.startswith("~/"):  # the remote home, as a shell would read it unquoted
            word = '"$HOME"/' + shlex.quote(base[2:])
        else:
            word = shlex.quote(base)
        return cls(word, f"launch-{secrets.token_hex(8)}")

    def path(self, file: str = "") -> str:
        """The shell word for the folder, or a file in it."""
        return f"{self.base}/{self.name}" + (f"/{file}" if file else "")

    def writer(self, file: str) -> str:
        """The remote command that writes ssh's stdin into `file`, readable by its owner only.
        The launch's folder is made 0700, or found made by this launch on a host that shares
        the filesystem; one that is a link or someone else's (in a shared base) fails the write."""
        return (
            f'umask 077 && d={self.path()} && mkdir -p -- {self.base} && {{ mkdir -- "$d" 2>/dev/null; '
            f'[ -d "$d" ] && [ ! -L "$d" ] && [ -O "$d" ]; }} && cat > "$d"/{file}'
        )

    def remover(self) -> str:
        return f"rm -rf -- {self.path()}"


def commands(
    hosts: list[str],
    deployment: Deployment,
    deployment_arg: str,
    *,
    workdir: str,
    model: str,
    port: int | None,
    coordinator_port: int,
    extra: list[str],
    secret_dir: SecretDir,
    api_key_file: bool = False,
) -> list[tuple[str, str]]:
    """(host, remote shell command) for every process of the deployment."""
    coordinator = coordinator_address(hosts[0], coordinator_port)
    out = []
    for process in deployment.processes:
        host = hosts[deployment.host_index(process.process_id, len(hosts))]
        argv = [
            ".venv/bin/jfire",
            "launch",
            deployment_arg,
            "--process-id",
            str(process.process_id),
            "--coordinator",
            coordinator,
            "--host",
            "0.0.0.0",
            "--model",
            model,
        ]
        if port is not None:
            argv += ["--port", str(port)]
        env = "JAX_PLATFORMS=cpu " if process.group is None else ""  # the frontend computes nothing
        out.append((host, _command(workdir, env, argv + extra, secret_dir, api_key_file and process.process_id == 0)))
    return out


def group_commands(
    hosts: list[str],
    *,
    workdir: str,
    model: str,
    port: int | None,
    coordinator_port: int,
    extra: list[str],
    secret_dir: SecretDir,
    api_key_file: bool = False,
) -> list[tuple[str, str]]:
    """(host, remote shell command) for each process of one engine spanning the hosts."""
    out = []
    for i, host in enumerate(hosts):
        argv = [
            ".venv/bin/jfire",
            "serve",
            "--model",
            model,
            "--coordinator",
            coordinator_address(hosts[0], coordinator_port),
            "--num-processes",
            str(len(hosts)),
            "--process-id",
            str(i),
            "--host",
            "0.0.0.0",
        ]
        if port is not None:
            argv += ["--port", str(port)]
        out.append((host, _command(workdir, "", argv + extra, secret_dir, api_key_file and i == 0)))
    return out


def _command(workdir: str, env: str, argv: list[str], secret_dir: SecretDir, api_key_file: bool) -> str:
    """`cd WORKDIR && [env] exec ARGV...`, every argument quoted for the remote shell; the
    secret files' paths are the only words it expands ("$HOME")."""
    secret = f"{deployment_secret.FILE_ENV}={secret_dir.path(SECRET_FILE)} "
    key = f" --api-key-file {secret_dir.path(API_KEY_FILE)}" if api_key_file else ""
    return f"cd {shlex.quote(workdir)} && {secret}{env}exec {shlex.join(argv)}{key}"


def _has_option(extra: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in extra)


def _api_key(args) -> bytes | None:
    """What the first host's API key file will hold: --api-key-file's content, or $JFIRE_API_KEY."""
    if args.api_key_file:
        text = Path(args.api_key_file).read_text()
        if not text.strip():
            raise JfireError(f"--api-key-file {args.api_key_file} holds no key (one a line)")
        return text.encode()
    key = os.environ.get("JFIRE_API_KEY")
    return (key.strip() + "\n").encode() if key and key.strip() else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hostfile")
    p.add_argument("deployment", nargs="?", help="a deployment file or name in meshes/ (not with --group)")
    p.add_argument(
        "--group",
        action="store_true",
        help="one engine over the hosts' devices (jfire serve on each host, process 0 serving)",
    )
    p.add_argument("--model", default="default")
    p.add_argument("--port", type=int, default=None, help="the frontend's port (default: the deployment's)")
    p.add_argument("--workdir", default=str(Path(__file__).resolve().parent.parent))
    p.add_argument(
        "--coordinator-port",
        type=int,
        default=None,
        help=f"default: the deployment's, or {DEFAULT_COORDINATOR_PORT} if it says 0",
    )
    p.add_argument(
        "--secret-dir",
        default=None,
        help="where on each host this launch's secret files go, in a 0700 folder of their own removed "
        "when the launch ends (default: ~/.jfire)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="a file here holding the API key(s), one a line, sent to the first host (default: $JFIRE_API_KEY, if set)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the ssh commands instead of running them")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after -- goes to jfire as it is (split here: argparse cannot tell it from an
    # omitted DEPLOYMENT).
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_intermixed_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    try:
        if args.group == (args.deployment is not None):
            raise JfireError("give a DEPLOYMENT, or --group (with the mesh after --), not both")
        if args.group and "--mesh" not in args.extra:
            raise JfireError("--group needs the engine's mesh over all hosts' devices: -- --mesh pp=2,tp=8")
        if _has_option(args.extra, "--api-key"):
            raise JfireError(
                "--api-key would put the key on a command line every user of the host can read: "
                "give --api-key-file FILE (or set $JFIRE_API_KEY) instead"
            )
        hosts = read_hosts(args.hostfile)
        if args.group and len(hosts) < 2:
            raise JfireError(f"--group spans hosts: {args.hostfile} lists {len(hosts)}; list at least 2")
        deployment = None if args.group else Deployment.load(args.deployment)
        secret = deployment_secret.from_env() or deployment_secret.DeploymentSecret.generate()
        api_key = None if _has_option(args.extra, "--api-key-file") else _api_key(args)
    except (JfireError, OSError) as e:
        print(f"launch_ssh: error: {e}", file=sys.stderr)
        return 2
    secret_dir = SecretDir.make(args.secret_dir)
    if deployment is None:
        plan = group_commands(
            hosts,
            workdir=args.workdir,
            model=args.model,
            port=args.port,
            coordinator_port=args.coordinator_port or DEFAULT_COORDINATOR_PORT,
            extra=args.extra,
            secret_dir=secret_dir,
            api_key_file=api_key is not None,
        )
    else:
        port = args.coordinator_port or deployment.coordinator_port or DEFAULT_COORDINATOR_PORT
        plan = commands(
            hosts,
            deployment,
            args.deployment,
            workdir=args.workdir,
            model=args.model,
            port=args.port,
            coordinator_port=port,
            extra=args.extra,
            secret_dir=secret_dir,
            api_key_file=api_key is not None,
        )
    # What each host is sent on ssh's stdin before the processes start (secrets, never argv).
    files = [(host, secret_dir.writer(SECRET_FILE), (secret.hex() + "\n").encode()) for host in dict.fromkeys(hosts)]
    if api_key is not None:
        files.append((plan[0][0], secret_dir.writer(API_KEY_FILE), api_key))
    if args.dry_run:
        print("# the secrets, each on its ssh's stdin into a file only its owner reads:")
        for host, command, _ in files:
            print(shlex.join(["ssh", "--", host, command]))
        print("# the processes:")
        for host, command in plan:
            print(shlex.join(["ssh", "-tt", "--", host, command]))
        return 0
    try:
        for host, command, data in files:
            written = subprocess.run(["ssh", "--", host, command], input=data)
            if written.returncode != 0:
                print(
                    f"launch_ssh: error: could not write this launch's secret files on {host} (ssh exited "
                    f"{written.returncode}; the folder {secret_dir.path()} must be new, or this user's own)",
                    file=sys.stderr,
                )
                return 1
        return _run(plan)
    finally:
        for host in dict.fromkeys(hosts):  # the secrets outlive no launch
            subprocess.run(["ssh", "--", host, secret_dir.remover()], stdin=subprocess.DEVNULL)


def _run(plan: list[tuple[str, str]]) -> int:
    procs = [subprocess.Popen(["ssh", "-tt", "--", host, command]) for host, command in plan]
    try:
        for proc in procs:
            proc.wait()
    except KeyboardInterrupt:
        for proc in reversed(procs):  # groups first, the frontend (coordinator) last
            proc.send_signal(signal.SIGINT)
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
