"""Start a deployment on several hosts over SSH: one `jfire launch --process-id` per process.

    .venv/bin/python scripts/launch_ssh.py HOSTFILE DEPLOYMENT [--model M] [--port P]
        [--workdir DIR] [--coordinator-port N] [--dry-run] [-- extra jfire launch options]
    .venv/bin/python scripts/launch_ssh.py HOSTFILE --group [--model M] [--port P] [--workdir DIR]
        [--coordinator-port N] [--dry-run] -- --mesh MESH [extra jfire serve options]

HOSTFILE lists one host per line (# comments). Processes go to hosts in contiguous blocks in
process order (process 0, the frontend and coordinator, on the first host), the same mapping
Slurm's block distribution gives. Every host needs this checkout at --workdir (default: the
same path as here) with its .venv set up, and the same deployment file. --dry-run prints the
commands instead of running them. Ctrl-C stops every remote process (ssh -tt forwards it).

--group runs one engine whose mesh spans the hosts instead (`jfire serve --coordinator`): one
process per host, the first host's the leader (it serves HTTP), each host's devices its part
of the mesh.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jfire.disagg.deployment import DEFAULT_COORDINATOR_PORT, Deployment  # noqa: E402
from jfire.errors import JfireError  # noqa: E402


def read_hosts(path: str) -> list[str]:
    hosts = [line.split("#")[0].strip() for line in Path(path).read_text().splitlines()]
    hosts = [h for h in hosts if h]
    if not hosts:
        raise JfireError(f"host file {path} lists no hosts (one per line)")
    return hosts


def commands(hosts: list[str], deployment: Deployment, deployment_arg: str, *, workdir: str, model: str,
             port: int | None, coordinator_port: int, extra: list[str]) -> list[tuple[str, str]]:
    """(host, remote shell command) for every process of the deployment."""
    coordinator = f"{hosts[0]}:{coordinator_port}"
    out = []
    for process in deployment.processes:
        host = hosts[deployment.host_index(process.process_id, len(hosts))]
        argv = [".venv/bin/jfire", "launch", deployment_arg, "--process-id", str(process.process_id),
                "--coordinator", coordinator, "--host", "0.0.0.0", "--model", model]
        if port is not None:
            argv += ["--port", str(port)]
        env = "JAX_PLATFORMS=cpu " if process.group is None else ""  # the frontend computes nothing
        out.append((host, f"cd {shlex.quote(workdir)} && {env}exec {shlex.join(argv + extra)}"))
    return out


def group_commands(hosts: list[str], *, workdir: str, model: str, port: int | None, coordinator_port: int,
                   extra: list[str]) -> list[tuple[str, str]]:
    """(host, remote shell command) for each process of one engine spanning the hosts."""
    out = []
    for i, host in enumerate(hosts):
        argv = [".venv/bin/jfire", "serve", "--model", model, "--coordinator", f"{hosts[0]}:{coordinator_port}",
                "--num-processes", str(len(hosts)), "--process-id", str(i), "--host", "0.0.0.0"]
        if port is not None:
            argv += ["--port", str(port)]
        out.append((host, f"cd {shlex.quote(workdir)} && exec {shlex.join(argv + extra)}"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hostfile")
    p.add_argument("deployment", nargs="?", help="a deployment file or name in meshes/ (not with --group)")
    p.add_argument("--group", action="store_true",
                   help="one engine over the hosts' devices (jfire serve on each host, process 0 serving)")
    p.add_argument("--model", default="default")
    p.add_argument("--port", type=int, default=None, help="the frontend's port (default: the deployment's)")
    p.add_argument("--workdir", default=str(Path(__file__).resolve().parent.parent))
    p.add_argument("--coordinator-port", type=int, default=None,
                   help=f"default: the deployment's, or {DEFAULT_COORDINATOR_PORT} if it says 0")
    p.add_argument("--dry-run", action="store_true", help="print the ssh commands instead of running them")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after -- goes to jfire as it is (split here: argparse cannot tell it from an
    # omitted DEPLOYMENT).
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    try:
        if args.group == (args.deployment is not None):
            raise JfireError("give a DEPLOYMENT, or --group (with the mesh after --), not both")
        if args.group and "--mesh" not in args.extra:
            raise JfireError("--group needs the engine's mesh over all hosts' devices: -- --mesh pp=2,tp=8")
        hosts = read_hosts(args.hostfile)
        if args.group and len(hosts) < 2:
            raise JfireError(f"--group spans hosts: {args.hostfile} lists {len(hosts)}; list at least 2")
        deployment = None if args.group else Deployment.load(args.deployment)
    except (JfireError, OSError) as e:
        print(f"launch_ssh: error: {e}", file=sys.stderr)
        return 2
    if deployment is None:
        plan = group_commands(hosts, workdir=args.workdir, model=args.model, port=args.port,
                              coordinator_port=args.coordinator_port or DEFAULT_COORDINATOR_PORT, extra=args.extra)
    else:
        port = args.coordinator_port or deployment.coordinator_port or DEFAULT_COORDINATOR_PORT
        plan = commands(hosts, deployment, args.deployment, workdir=args.workdir, model=args.model, port=args.port,
                        coordinator_port=port, extra=args.extra)
    if args.dry_run:
        for host, command in plan:
            print(shlex.join(["ssh", "-tt", host, command]))
        return 0
    procs = [subprocess.Popen(["ssh", "-tt", host, command]) for host, command in plan]
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
