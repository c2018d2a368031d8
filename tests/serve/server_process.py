"""Starting real servers for the tests: `jfire serve` as a subprocess on a loopback port."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jfire.disagg.launch import free_port


@dataclasses.dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log: Path
    health_seen: list[int]  # /health status codes, in order, until ready

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_server(args: list[str], log: Path, timeout: float = 600) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "jfire.cli", "serve", "--port", str(port), *args]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    seen: list[int] = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"jfire serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            status = httpx.get(url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            time.sleep(0.2)
            continue
        seen.append(status)
        if status == 200:
            return ServerProcess(url, process, log, seen)
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"jfire serve not ready after {timeout} s:\n{log.read_text()}")
