"""`jfire launch`: start a deployment's processes.

Without --process-id it launches every process of the deployment on this machine (the
frontend, which hosts the jax.distributed coordinator, then each group process with its own
count of host devices), relays their logs, restarts a group process that dies once the deployment is up (up to
--max-restarts times; the restarted process rejoins the cluster and registers again, and the
frontend routes to it once it is ready), and on Ctrl-C drains the frontend, then stops the
groups and the frontend last (the groups need the coordinator to leave cleanly).

With --process-id N --coordinator HOST:PORT it runs just process N: this is what the SSH and
Slurm launchers in scripts/ start on each host, with the same deployment file.

Every process holds the deployment secret (jfire.deployment_secret), which signs what they
leave in the cluster's store: a local launch makes one (or takes the operator's) and hands it
to its processes in their environment; a process started alone reads it from its own.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from jfire import deployment_secret, quiet
from jfire import mesh as meshes
from jfire.deployment_secret import DeploymentSecret
from jfire.disagg.deployment import Deployment, Process
from jfire.errors import JfireError

STOP_GRACE_S = 10.0


@dataclasses.dataclass
class Options:
    """What every process of a launch is given, besides its process id."""

    model: str = "default"
    dtype: str = "float32"
    host: str = "127.0.0.1"  # the frontend's HTTP bind address
    port: int | None = None  # the frontend's port (default: the deployment's)
    engine_args: tuple[str, ...] = ()  # --kv-cache-gb etc., passed through to the groups' engines
    shutdown_grace: float = 30.0  # seconds in-flight requests get to finish when the launch stops
    max_restarts: int = 3  # times each group process is restarted if it dies after start-up
    access_log: bool = True  # the frontend's line per request (serve/access_log.py)
    host_kv_bytes: int = 0  # each prefill group's host-memory tier (jfire.host_tier); 0: none
    host_kv_min_uses: int = 1  # its reuse gating: prompts a block served before it is kept
    route_by_prefix: bool = True  # the frontend's choice of prefill group (jfire.disagg.prefix_index)
    image_flags: tuple[str, ...] = ()  # the frontend's limits on images (--max-images etc.), as given
    image_limits: object = None  # those limits (jfire.vision.images.ImageLimits; None: its defaults)
    # The frontend's API keys (serve/api_keys.py). The key reaches it in its environment, never
    # on a command line (which `ps` shows); a key file by its path.
    api_key: str | None = dataclasses.field(default=None, repr=False)
    api_key_file: str | None = None
    cache_salt_per_key: bool = False  # each key's prompts hash apart

    def argv(self) -> list[str]:
        out = [
            "--model",
            self.model,
            "--dtype",
            self.dtype,
            "--host",
            self.host,
            "--shutdown-grace",
            f"{self.shutdown_grace:g}",
        ]
        if self.port is not None:
            out += ["--port", str(self.port)]
        if not self.access_log:
            out += ["--no-access-log"]
        if not self.route_by_prefix:
            out += ["--no-prefix-routing"]
        if self.api_key_file is not None:
            out += ["--api-key-file", self.api_key_file]
        if self.cache_salt_per_key:
            out += ["--cache-salt-per-key"]
        return out + list(self.image_flags) + list(self.engine_args)


def process_argv(deployment_arg: str, process_id: int, coordinator: str, options: Options) -> list[str]:
    """The `jfire launch` arguments that run one process of the deployment."""
    return ["launch", deployment_arg, "--process-id", str(process_id), "--coordinator", coordinator, *options.argv()]


def process_env(process: Process, base: dict | None = None) -> dict:
    """Environment for one local process: its own count of host devices (for CPU runs); the
    frontend computes nothing, so it stays on the CPU."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={process.devices}"])
    if process.group is None:
        env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def with_api_key(process: Process, options: Options, env: dict) -> dict:
    """`env` with the API key for the frontend and none for a group (which serves no API)."""
    from serve.api_keys import ENV

    env = {k: v for k, v in env.items() if k != ENV}
    if process.group is None and options.api_key:
        env[ENV] = options.api_key
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def check_model(deployment: Deployment, model: str) -> Path:
    """The model's path, once its config reads and every group's mesh fits it (else JfireError)."""
    from jfire.checkpoint.load import load_config_and_tokenizer, resolve_model_path

    path = resolve_model_path(model)[0]
    config = load_config_and_tokenizer(str(path))[0]
    for group in deployment.groups:
        try:
            meshes.check_fits(group.mesh, config, group.mesh.size)
        except JfireError as e:
            raise JfireError(f"group {group.name!r} of deployment {deployment.name!r}: {e}") from None
    return path


def launch_local(deployment: Deployment, deployment_arg: str, options: Options, secret: DeploymentSecret) -> int:
    """Runs every process of the deployment here until Ctrl-C (or the frontend exits), each
    given `secret` in its environment."""
    launched_at = time.time()  # the groups' ready lines say how long after it they were ready
    # Convert the default model once, before several processes would race to, and refuse a
    # model that is missing or that a group's mesh cannot take before any process starts.
    options = dataclasses.replace(options, model=str(check_model(deployment, options.model)))
    port = deployment.coordinator_port
    if port == 0:
        port = free_port()
    elif not _port_free(port):
        raise JfireError(
            f"the coordinator port {port} of deployment {deployment.name!r} is in use; "
            "set [coordinator] port = 0 in the deployment file to pick a free one"
        )
    coordinator = f"127.0.0.1:{port}"
    frontend_port = options.port if options.port is not None else deployment.frontend_port
    print(
        f"jfire: launch: {deployment.name}: coordinator {coordinator}, frontend http://{options.host}:"
        f"{frontend_port}, {len(deployment.processes)} processes",
        file=sys.stderr,
        flush=True,
    )
    children: list[tuple[Process, subprocess.Popen]] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    def start(process: Process, started_at: float) -> subprocess.Popen:
        argv = [
            sys.executable,
            "-m",
            "jfire.cli",
            *process_argv(deployment_arg, process.process_id, coordinator, options),
        ]
        # A session of its own: Ctrl-C reaches only this launcher, which stops them in order.
        env = with_api_key(process, options, {**process_env(process), "JFIRE_LAUNCHED_AT": f"{started_at:.3f}"})
        env.update(deployment_secret.to_env(secret))  # never in argv: `ps` shows that to every user
        # Its output comes through here, less the listed noise of JAX and Gloo (quiet.py).
        child = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        quiet.relay(child.stdout, sys.stdout.buffer)
        quiet.relay(child.stderr, sys.stderr.buffer)
        print(
            f"jfire: launch: process {process.process_id} {process.label} ({process.devices} devices): pid {child.pid}",
            file=sys.stderr,
            flush=True,
        )
        return child

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    restarts = {p.process_id: 0 for p in deployment.processes}
    left_down: set[int] = set()  # processes that died once too often
    ready, failed = False, False
    try:
        for process in deployment.processes:
            children.append((process, start(process, launched_at)))
        frontend_url = f"http://{'127.0.0.1' if options.host in ('0.0.0.0', '::') else options.host}:{frontend_port}"
        while not stopping:
            time.sleep(0.2)
            if not ready and _healthy(frontend_url):
                ready = True
                print(
                    f"jfire: launch: {deployment.name}: ready, {time.time() - launched_at:.1f} s after launch "
                    f"(http://{options.host}:{frontend_port})",
                    file=sys.stderr,
                    flush=True,
                )
            for process, child in children:
                code = child.poll()
                if code is None or stopping or process.process_id in left_down:
                    continue
                print(
                    f"jfire: launch: {process.label} (pid {child.pid}) exited with code {code}",
                    file=sys.stderr,
                    flush=True,
                )
                # Nothing is served without the frontend; a process that fails while the
                # deployment starts (a bad mesh, a missing model) fails the launch.
                if process.group is None or not ready:
                    stopping = failed = True
                    continue
                # A group spanning processes lives and dies whole: its other processes stop
                # too, and the group restarts together.
                members = [j for j, (p, _) in enumerate(children) if p.group == process.group]
                for j in members:
                    if children[j][1].poll() is None:
                        children[j][1].kill()
                        children[j][1].wait()
                first = children[members[0]][0].process_id
                if restarts[first] < options.max_restarts:
                    restarts[first] += 1
                    print(
                        f"jfire: launch: restarting {process.group.name if len(members) > 1 else process.label} "
                        f"(restart {restarts[first]} of {options.max_restarts})",
                        file=sys.stderr,
                        flush=True,
                    )
                    for j in members:
                        children[j] = (children[j][0], start(children[j][0], time.time()))
                else:
                    print(
                        f"jfire: launch: {process.label} is left down (restarted {options.max_restarts} times "
                        "already); the frontend routes around it",
                        file=sys.stderr,
                        flush=True,
                    )
                    left_down.update(children[j][0].process_id for j in members)
    finally:
        if ready and not failed:
            _drain_frontend(children, frontend_url, options.shutdown_grace)
        _stop_all(children)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failed:
        print(
            "jfire: launch: error: a process exited; see its error above. All processes stopped.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print("jfire: launch: all processes stopped", file=sys.stderr, flush=True)
    return 0


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _drain_frontend(children: list[tuple[Process, subprocess.Popen]], url: str, grace_s: float) -> None:
    """Before anything stops: the frontend stops admitting (503, /health "draining") and its
    in-flight requests finish through the groups, for up to grace_s; only then are the groups
    and the frontend stopped (the frontend last: it hosts the coordinator)."""
    import httpx

    frontend = [c for p, c in children if p.group is None and c.poll() is None]
    if not frontend:
        return
    print(f"jfire: launch: draining: in-flight requests have {grace_s:g} s to finish", file=sys.stderr, flush=True)
    frontend[0].send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + grace_s + 10
    while time.monotonic() < deadline and frontend[0].poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).json().get("drained"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)


def _stop_all(children: list[tuple[Process, subprocess.Popen]]) -> None:
    """Groups first, then the frontend (it hosts the coordinator); SIGKILL after a grace period."""
    groups = [c for p, c in children if p.group is not None]
    frontend = [c for p, c in children if p.group is None]
    for batch in (groups, frontend):
        for child in batch:
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in batch:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def run_one(
    deployment: Deployment,
    process_id: int,
    coordinator: str,
    options: Options,
    engine_config,
    served_name: str,
    pool_size=None,
    *,
    secret: DeploymentSecret,
) -> int:
    """Runs one process of the deployment in this process. `pool_size`: how a group sizes its
    page pool (a jfire.device_memory.PoolSize; None: as `engine_config` says). `secret`: the
    deployment's, the same in every process."""
    from jfire.memory import limit_malloc_arenas, trim_freed_memory_periodically

    limit_malloc_arenas()  # before the threads that allocate start (jfire/memory.py)
    trim_freed_memory_periodically()  # a long-running server gives back what it freed
    process = deployment.process(process_id)
    if process.group is None:
        _run_frontend(deployment, coordinator, options, engine_config, served_name, secret)
    else:
        from jfire.disagg import worker

        bind = options.host
        advertise = bind if bind not in ("0.0.0.0", "::") else socket.getfqdn()
        worker.run(
            deployment,
            process,
            model=options.model,
            dtype=options.dtype,
            coordinator=coordinator,
            bind_host=bind,
            advertise_host=advertise,
            config=engine_config,
            host_kv_bytes=options.host_kv_bytes,
            host_kv_min_uses=options.host_kv_min_uses,
            pool_size=pool_size,
            secret=secret,
        )
    sys.stderr.flush()
    # Skip interpreter teardown: the coordinator client's own shutdown would wait on peers, and
    # a pull still within its deadline would hold the transfer server up.
    os._exit(0)


def _run_frontend(deployment: Deployment, coordinator: str, options: Options, engine_config, served_name, secret):
    import uvicorn

    from jfire.checkpoint.load import load_config_and_tokenizer
    from jfire.disagg import cluster
    from jfire.disagg.frontend import RemoteEngine
    from serve import listen
    from serve.app import create_app
    from serve.uvicorn_config import ConnectionLimits, uvicorn_config

    port = options.port if options.port is not None else deployment.frontend_port
    sock = listen.bind(options.host, port, "the frontend")
    store = cluster.join(coordinator, len(deployment.processes), 0, secret=secret, collectives=False)
    config, tokenizer, _ = load_config_and_tokenizer(options.model)
    engine = RemoteEngine(
        deployment,
        store,
        config,
        tokenizer,
        max_model_len=engine_config.max_model_len,
        max_waiting=engine_config.max_waiting,
        route_by_prefix=options.route_by_prefix,
        vision=_frontend_vision(options.model, tokenizer),
        secret=secret,
    )
    engine.start()
    state = frontend_state(engine, options, served_name, secret)
    app = create_app(state)

    def start_draining(*_):  # the launcher's signal that the deployment is stopping
        from serve.server import drain

        def drain_then_stop():
            drain(state, options.shutdown_grace)
            engine.stopping = True  # the groups stop next: expected, not reported

        if not state.draining:
            state.draining = True
            threading.Thread(target=drain_then_stop, name="jfire-drain", daemon=True).start()

    signal.signal(signal.SIGUSR1, start_draining)
    print(
        f"jfire: frontend: serving {served_name!r} on http://{options.host}:{sock.getsockname()[1]} "
        "(/health says when every group is ready)",
        file=sys.stderr,
        flush=True,
    )
    try:
        limits = ConnectionLimits.for_queue(engine_config.max_waiting + engine_config.max_batch)
        server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning", timeout_graceful_shutdown=3))
        server.run(sockets=[sock])
    finally:
        engine.shutdown()


def frontend_state(engine, options: Options, served_name: str, secret: DeploymentSecret | None):
    """The frontend's server state: its API keys (the key from its environment, those of the key
    file) and the deployment secret, whose control token also shows /health's group addresses."""
    from serve import api_keys
    from serve.app import ServerState

    state = ServerState(
        engine=engine,
        model_name=served_name,
        api_keys=api_keys.gather(options.api_key, options.api_key_file),
        access_log=options.access_log,
        deployment_secret=secret,
        cache_salt_per_key=options.cache_salt_per_key,
    )
    if options.image_limits is not None:
        state.image_limits = options.image_limits
    return state


def _frontend_vision(model: str, tokenizer):
    """The model's image preprocessing and placeholders, without the encoder (the prefill
    groups run it), or None for a text-only model or a jfire checkpoint."""
    from jfire.checkpoint.load import resolve_model_path
    from jfire.vision.model import load_vision_model

    path, _ = resolve_model_path(model)
    return load_vision_model(path, tokenizer=tokenizer, weights=False) if path.is_dir() else None
