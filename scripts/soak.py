"""Soaks `jfire serve` and `jfire launch` deployments of the default model with mixed agent
traffic (jfire/soak.py has the workload and what is measured), one after the other.

    .venv/bin/python scripts/soak.py [--targets serve,local-1p1d,local-2p1d] [--minutes 12]
        [--context 2048] [--sample-s 30] [--output soak.json]

Each target is started by this script on a free loopback port with the same engine options
(log in /tmp/jfire-soak-TARGET.log), soaked, and stopped. For each it prints the samples as they
come, then: requests by kind and outcome, 5xx and stream error events by cause, the transfers
failed, the probe's outputs, per process RSS/descriptors/threads with a linear fit of RSS after
the warm-up, and what is held once idle. The goals (docs/disaggregation.md): 0 transfers failed,
0 5xx and 0 stream error events, one probe output, RSS growth after 2 minutes under 30 MiB per
10 minutes in every process, every page back once idle.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jfire import deployment_secret, soak  # noqa: E402
from jfire.disagg.launch import free_port  # noqa: E402

# A deployment's secret, as an operator gives one: its control token shows /health's group
# addresses and opens the groups' control routes, which the soak reads.
SECRET = deployment_secret.DeploymentSecret.generate()


def start(target: str, port: int, engine_args: list[str], log: Path) -> subprocess.Popen:
    if target == "serve":
        cmd = [sys.executable, "-m", "jfire.cli", "serve", "--port", str(port), *engine_args]
    else:
        cmd = [sys.executable, "-m", "jfire.cli", "launch", target, "--port", str(port), *engine_args]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", **deployment_secret.to_env(SECRET)})


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"soak: the server exited with {process.returncode}; see {log}")
        try:
            health = httpx.get(url + "/health", timeout=2)
            if health.status_code == 200 and not health.json().get("compiling"):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"soak: not ready after {timeout_s:.0f} s; see {log}")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="serve,local-1p1d,local-2p1d",
                        help="comma-separated: serve and/or deployment names in meshes/")
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--context", type=int, default=2048, help="--max-context of every target")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="soak.json")
    args = parser.parse_args()
    engine_args = ["--max-context", str(args.context), "--max-batch", str(args.max_batch)]
    config = soak.SoakConfig(duration_s=args.minutes * 60, context=args.context, sample_s=args.sample_s,
                             probe_s=args.sample_s, warmup_s=args.warmup_s, seed=args.seed)
    results = {}
    for target in args.targets.split(","):
        port, log = free_port(), Path(f"/tmp/jfire-soak-{target}.log")
        url = f"http://127.0.0.1:{port}"
        print(f"soak: {target}: starting on {url} (log {log})", flush=True)
        process = start(target, port, engine_args, log)
        try:
            wait_ready(url, process, log)
            deployment = (soak.Deployment(url, server_pid=process.pid) if target == "serve"
                          else soak.Deployment(url, launcher_pid=process.pid,
                                               control_headers={"Authorization": f"Bearer {SECRET.bearer()}"}))
            result = soak.run(deployment, config, log=lambda line: print(line, flush=True))
        finally:
            stop(process)
        print(f"\nsoak: {target}, {args.minutes:g} minutes")
        soak.print_report(result)
        print(flush=True)
        results[target] = result
    Path(args.output).write_text(json.dumps(results, indent=1))
    print(f"soak: written to {args.output}")


if __name__ == "__main__":
    main()
