"""Running a real deployment for the tests: `jfire launch` as a subprocess, which starts the
frontend and every group as separate OS processes on this machine."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jfire import deployment_secret
from jfire.deployment_secret import DeploymentSecret
from jfire.disagg.launch import free_port
from tests.limits import DEPLOYMENT_LIMITS, SERVE_LIMITS

REPO = Path(__file__).resolve().parents[2]


def deployment_file(tmp_path: Path, name: str, *, timeout_s: float) -> Path:
    """A copy of meshes/NAME.toml with a short transfer timeout (so expiry is observable)."""
    text = (REPO / "meshes" / f"{name}.toml").read_text()
    text = text.replace("timeout_s = 30", f"timeout_s = {timeout_s}")
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


@dataclasses.dataclass
class Running:
    url: str
    process: subprocess.Popen
    log: Path
    health: dict  # as the deployment's control token sees it: with the groups' addresses and pids
    secret: DeploymentSecret  # the deployment's, given to the launch in its environment
    api_keys: tuple[str, ...] = ()  # the frontend's (its --api-key-file), if it has any

    @property
    def control_auth(self) -> dict:
        """The header that shows /health's group addresses and opens the groups' control routes."""
        return {"Authorization": f"Bearer {self.secret.bearer()}"}

    @property
    def auth(self) -> dict:
        """The header the frontend's API needs (none for an open one)."""
        return {"Authorization": f"Bearer {self.api_keys[0]}"} if self.api_keys else {}

    def group(self, role: str) -> dict:
        return next(g for g in self.health["groups"].values() if g["role"] == role)

    def stats(self, role: str) -> dict:
        return httpx.get(self.group(role)["control"] + "/stats", headers=self.control_auth, timeout=5).json()

    def stop(self) -> int:
        """Ctrl-C, as a user would: the launcher stops every process."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


def launch(deployment: Path, log: Path, timeout: float = 900, extra: tuple[str, ...] = (),
           api_keys: tuple[str, ...] = ()) -> Running:
    """`jfire launch` with a deployment secret of the test's (in its environment, as an operator
    gives one) and, with `api_keys`, a key file of them (--api-key-file)."""
    port = free_port()
    secret = DeploymentSecret.generate()
    if api_keys:
        key_file = log.parent / "api-keys"
        key_file.write_text("# the frontend's API keys\n" + "".join(f"{key}\n" for key in api_keys))
        key_file.chmod(0o600)
        extra = (*extra, "--api-key-file", str(key_file))
    cmd = [sys.executable, "-m", "jfire.cli", "launch", str(deployment), "--port", str(port), *DEPLOYMENT_LIMITS, *extra]
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO,
                               env={**os.environ, **deployment_secret.to_env(secret)}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    control_auth = {"Authorization": f"Bearer {secret.bearer()}"}
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"jfire launch exited with {process.returncode}:\n{log.read_text()}")
        try:
            r = httpx.get(url + "/health", headers=control_auth, timeout=2)
        except httpx.HTTPError:
            time.sleep(0.3)
            continue
        if r.status_code == 200:
            return Running(url, process, log, r.json(), secret, api_keys)
        if r.json().get("status") == "error":  # a group failed to start: no use waiting
            os.killpg(process.pid, signal.SIGKILL)
            raise RuntimeError(f"deployment failed to start: {r.json()['message']}\n{log.read_text()}")
        time.sleep(0.3)
    os.killpg(process.pid, signal.SIGKILL)
    raise RuntimeError(f"deployment not ready after {timeout} s:\n{log.read_text()}")


@contextlib.contextmanager
def launched(tmp_path: Path, name: str, text: str, extra: tuple[str, ...] = ()):
    """The deployment file `text`, written as NAME.toml in tmp_path and launched; stopped after,
    as a user would, and required to exit 0."""
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    running = launch(path, tmp_path / "launch.log", extra=extra)
    yield running
    code = running.stop()
    assert code == 0, running.log.read_text()[-3000:]


def assert_quiet(log: Path) -> None:
    """A launch's output (through its clean stop) holds none of the noise jfire.quiet drops, in
    any form, and no group reported down once the launch was draining."""
    lines = log.read_text().splitlines()
    noisy = [x for x in lines if "Using experimental recoverable task feature" in x or x.startswith("[Gloo] Rank")]
    assert not noisy, noisy[:5]
    drained = next((i for i, x in enumerate(lines) if x.startswith("jfire: launch: draining")), len(lines))
    assert not [x for x in lines[drained:] if " is down: " in x], lines[drained:]


def wait_for(predicate, timeout: float, what: str):
    """Polls until predicate() is truthy and returns its value; fails after timeout seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def colocated(prompts: list[dict], tmp_path: Path, model: str = "default", engine_args: tuple = ()) -> list[dict]:
    """The same prompts through colocated `jfire generate` (one process, one engine)."""
    src, out = tmp_path / "prompts.jsonl", tmp_path / "colocated.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    subprocess.run([sys.executable, "-m", "jfire.cli", "generate", "--prompts-file", str(src), "--output", str(out),
                    *SERVE_LIMITS, *engine_args, "--model", model], check=True, cwd=REPO,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [r for r in sorted(rows, key=lambda r: r["index"])]


def greedy_tokens(model: Path, prompts: list[dict], tmp_path: Path, *args: str) -> list[list[int]]:
    """Each prompt's greedy tokens (eos ignored) from colocated `jfire generate` of `model`,
    with the deployments' limits and `args` (--mesh, --dtype ...)."""
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    run = subprocess.run([sys.executable, "-m", "jfire.cli", "generate", "--model", str(model), "--prompts-file",
                          str(src), "--ignore-eos", *args, *DEPLOYMENT_LIMITS],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = sorted((json.loads(line) for line in run.stdout.splitlines()), key=lambda r: r["index"])
    return [r["token_ids"] for r in rows]


def expected_kv_bytes(prompt_tokens: list[int], page_size: int = 16, model: str = "default") -> int:
    """The prompt KV cache of these requests, from the model's own config: whole pages of
    [k, v] x layers x KV heads x page slots x head dim, float32."""
    from jfire.checkpoint.load import load_config_and_tokenizer

    cfg, _, _ = load_config_and_tokenizer(model)
    page = 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * 4
    return sum(-(-n // page_size) * page for n in prompt_tokens)


def metric(url: str, name: str, headers: dict | None = None) -> float:
    for line in httpx.get(url + "/metrics", headers=headers, timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
