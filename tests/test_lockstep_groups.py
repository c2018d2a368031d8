"""One engine over a mesh that spans processes (jfire.lockstep): real `jfire` processes joined
by jax.distributed (gloo collectives on CPU), against one process on one device.

Every group here is 2 processes; the leader schedules, the follower replays its calls. Its
greedy tokens must equal one device's, as those of one process holding the same mesh do
(tests/mesh, tests/test_cli_mesh.py)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import openai
import pytest

from jfire import lockstep
from jfire.checkpoint import store
from jfire.deployment_secret import DeploymentSecret, to_env
from jfire.disagg.launch import free_port
from jfire.models.llama import LlamaConfig
from jfire.models.params import init_params

# 16 heads and 8 experts: meshes of tp=8 and ep=8 fit; 8 layers: pp=2 splits them.
DENSE = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                    num_layers=8, num_heads=16, num_kv_heads=8, head_dim=8, max_position_embeddings=256,
                    rope_theta=10000.0, qkv_bias=True)
MOE = LlamaConfig(architecture="MixtralForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=96,
                  num_layers=4, num_heads=8, num_kv_heads=4, head_dim=8, max_position_embeddings=256,
                  num_experts=8, experts_per_token=2, moe_intermediate_size=96, router="softmax_topk")
# Small buckets: few programs to compile, and compiled quickly (a few tokens each).
ENGINE_ARGS = ["--max-batch", "4", "--prefill-budget", "32", "--max-context", "128", "--quick-compile",
               "--kv-cache-gb", "0.01"]
# The first repeats itself, and the dense model's answer does too: a speculating group's drafts hold.
PROMPTS = [{"prompt_ids": [7] * 8, "max_tokens": 8},
           {"prompt_ids": [7, 7, 7], "max_tokens": 6},
           {"prompt_ids": [3, 100, 400, 2, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28,
                           29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], "max_tokens": 10}]
JFIRE = [sys.executable, "-m", "jfire.cli"]
# A leader whose group has failed exits after 1 s for the errors to reach the clients, uvicorn's
# graceful shutdown (up to 5 s) and the engine's, which first lets a background compilation in
# progress finish: under 10 s on a quiet machine, over 10 s once beside a busy loop on these 2
# cores. The tests bound that generously: what they check is that it exits by itself, with an
# error (and, for a follower lost while idle, why: its log says).
EXIT_ALLOWANCE_S = 60
GROUP_SECRET = DeploymentSecret.generate()
MODELS_DIR: dict[str, str] = {}  # model name -> its checkpoint (the `models` fixture fills it)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Jfire checkpoints of the tiny dense and MoE models (random weights, wide enough margins)."""
    out = {}
    for name, cfg, scale in (("dense", DENSE, 0.1), ("moe", MOE, 0.2)):
        path = tmp_path_factory.mktemp(name)
        store.save(path, cfg, init_params(cfg.param_specs(), jax.random.key(0), jnp.float32, scale=scale), "float32")
        out[name] = MODELS_DIR[name] = str(path)
    out["default"] = "default"
    return out


def group_command(args: list[str], process_id: int, port: int, devices: int) -> list[str]:
    return [*JFIRE, *args, "--cpu-devices", str(devices), "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2", "--process-id", str(process_id)]


def group_env() -> dict:
    """A group's processes share a deployment secret, given in their environment."""
    return {**os.environ, **to_env(GROUP_SECRET)}


def start_group(args: list[str], devices_each: int, logs: Path) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen(group_command(args, i, port, devices_each), stdout=subprocess.PIPE,
                             stderr=open(logs / f"process{i}.log", "w"), text=True, env=group_env())
            for i in range(2)]


def generate_args(model: str, mesh: str, tmp: Path) -> list[str]:
    """The MoE model runs a batch of prompts (several rows per step); the others one prompt
    each, compiling only the programs it uses."""
    common = ["generate", "--model", MODELS_DIR.get(model, model), "--mesh", mesh, "--ignore-eos", *ENGINE_ARGS]
    if model == "moe":
        src = tmp / "prompts.jsonl"
        src.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
        return [*common, "--prompts-file", str(src)]
    prompt = ["--prompt", "The capital of France is"] if model == "default" else \
        ["--prompt-ids", ",".join(map(str, PROMPTS[0]["prompt_ids"]))]
    return [*common, *prompt, "--max-tokens", str(PROMPTS[0]["max_tokens"]), "--json"]


def results(stdout: str) -> list[list[int]]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    return [r["token_ids"] for r in sorted(rows, key=lambda r: r.get("index", 0))]


@pytest.fixture(scope="module")
def one_device(models, tmp_path_factory):
    """model -> its greedy tokens for the module's prompts in one process on one device (every
    mesh used here gives one device's tokens in one process: tests/mesh, tests/test_cli_mesh.py)."""
    made = {}

    def tokens(model: str) -> list[list[int]]:
        if model not in made:
            prompts = PROMPTS if model == "moe" else PROMPTS[:1]
            run = subprocess.run([*JFIRE, *generate_args(model, "single", tmp_path_factory.mktemp(model))],
                                 capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, run.stderr[-2000:]
            made[model] = results(run.stdout)
            assert [len(t) for t in made[model]] == [p["max_tokens"] for p in prompts]
        return made[model]

    return tokens


# pp=2,tp=4 for the dense model (a pipeline stage per process): the serving test below.
@pytest.mark.parametrize("model,mesh,devices_each", [
    ("dense", "tp=8", 4),        # tensor parallelism across the two processes
    ("moe", "pp=2,ep=2,tp=2", 4),  # the expert exchange within each process, stages across
    ("default", "pp=2,tp=3", 3),  # 9 heads: tp=3 per stage
])
def test_group_of_two_processes_equals_one_device(models, one_device, tmp_path, model, mesh, devices_each):
    args = generate_args(model, mesh, tmp_path)
    if model == "dense":
        # The group speculates too: the leader drafts, every process runs the verify calls.
        args += ["--speculative", "suffix", "--num-draft-tokens", "4"]
    group = start_group(args, devices_each, tmp_path)
    outs = [p.communicate(timeout=600)[0] for p in group]
    for i, p in enumerate(group):
        assert p.returncode == 0, (tmp_path / f"process{i}.log").read_text()[-3000:]
    assert outs[1] == ""  # the follower prints nothing: the leader answers for the group
    assert results(outs[0]) == one_device(model)
    follower_log = (tmp_path / "process1.log").read_text()
    assert "follows process 0" in follower_log
    if model == "dense":
        counts = json.loads(outs[0])["speculative"]
        assert counts["spec_verify_rows"] > 0 and counts["spec_accepted_tokens"] > 0, counts


def test_follower_started_with_other_settings_refuses(models, tmp_path):
    """A follower whose page pool would differ from the leader's says so and stops; the
    leader, left alone in its group, fails and exits too (it never serves alone)."""
    args = ["generate", "--model", models["dense"], "--mesh", "pp=2,tp=4", "--prompt-ids", "1,2,3", *ENGINE_ARGS]
    port = free_port()
    leader = subprocess.Popen(group_command(args, 0, port, 4), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=group_env())
    odd = [*args[:-1], "0.02"]  # --kv-cache-gb 0.02 instead of 0.01
    follower = subprocess.run(group_command(odd, 1, port, 4), capture_output=True, text=True, timeout=300,
                              env=group_env())
    assert follower.returncode == 2
    assert "differ from the group leader's" in follower.stderr and "pages: leader" in follower.stderr
    leader.communicate(timeout=120)
    assert leader.returncode != 0


def wait_ready(url: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a group process exited while starting"
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("status") == "ok":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the group did not become ready within {timeout} s")


def launcher_group(tmp_path: Path, model: str, serve_options: list[str]) -> list[subprocess.Popen]:
    """The commands `scripts/launch_ssh.py --group` would run over SSH, run here directly: first
    those writing the deployment secret from their stdin, then the processes."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n127.0.0.1\n")
    plan = subprocess.run([sys.executable, "scripts/launch_ssh.py", str(hosts), "--group", "--dry-run", "--model", model,
                           "--coordinator-port", str(free_port()), "--secret-dir", str(tmp_path / "secrets"), "--",
                           *serve_options, "--cpu-devices", "4"],
                          capture_output=True, text=True, cwd=REPO, check=True).stdout.splitlines()
    secret = DeploymentSecret.generate().hex() + "\n"
    procs = []
    for line in (line for line in plan if not line.startswith("#")):
        ssh, *options, host, command = shlex.split(line)
        assert (ssh, host, options[-1]) == ("ssh", "127.0.0.1", "--")
        if options == ["--"]:  # one of the secret's writers
            subprocess.run(["bash", "-c", command], input=secret, text=True, check=True)
            continue
        i = len(procs)
        assert options == ["-tt", "--"] and f"--process-id {i}" in command
        procs.append(subprocess.Popen(["bash", "-c", command], stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"launched{i}.log", "w")))
    return procs


def test_killing_the_follower_ends_the_stream_and_the_group(models, one_device, tmp_path):
    """A follower dying mid-stream: the client gets a clear error within 10 s and the leader
    exits; the group started again serves the same tokens as before, and its leader exits by
    itself when its follower dies while the group is idle."""
    port = free_port()
    options = ["--mesh", "pp=2,tp=4", "--port", str(port), *ENGINE_ARGS]
    args = ["serve", "--model", models["dense"], *options]
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    prompt, served = PROMPTS[0]["prompt_ids"], Path(models["dense"]).name

    def complete(max_tokens: int) -> list[int]:
        out = client.completions.create(model=served, prompt=prompt, max_tokens=max_tokens,
                                        temperature=0, logprobs=1, extra_body={"ignore_eos": True})
        return [int(t) for t in out.choices[0].logprobs.tokens]

    group = start_group(args, 4, tmp_path)
    try:
        wait_ready(url, group)
        before = complete(8)
        assert before == one_device("dense")[0]
        # logprobs: a chunk per token (this model has no tokenizer, so no text to stream).
        stream = client.completions.create(model=served, prompt=prompt, max_tokens=120, temperature=0, logprobs=1,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)  # the stream is running
        group[1].send_signal(signal.SIGSTOP)  # the leader stalls at its next collective: mid-stream for sure
        group[1].send_signal(signal.SIGKILL)
        killed, received = time.monotonic(), 1
        with pytest.raises(openai.APIError) as failure:
            for _ in chunks:
                received += 1
        assert time.monotonic() - killed < 10
        assert received < 120
        assert "group spanning processes" in str(failure.value)
        group[0].wait(timeout=EXIT_ALLOWANCE_S)  # the leader exits by itself
        assert group[0].returncode not in (0, None)
    finally:
        for p in group:
            if p.poll() is None:
                p.kill()
    # Started again as the SSH launcher would start it on two hosts (here both 127.0.0.1).
    group = launcher_group(tmp_path, models["dense"], options)
    try:
        wait_ready(url, group)
        assert complete(8) == before
        # The follower dying while the group is idle: no request is needed for the leader to
        # exit. Whichever notices the silence first stops it: the leader's check of its
        # follower's beats (tests/test_lockstep_beats.py) or JAX's own heartbeat (10 s both).
        # (A group stopped with SIGTERM exits 0: tests/disagg/test_disagg_groups.py.)
        group[1].kill()
        group[0].wait(timeout=lockstep.FOLLOWER_TIMEOUT_S + EXIT_ALLOWANCE_S)
        assert group[0].returncode not in (0, None)
        log = (tmp_path / "launched0.log").read_text()
        assert "process 1 of the group stopped: no sign of life" in log or "stopped sending heartbeats" in log
    finally:
        for p in group:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("args,message", [
    (["--coordinator", "127.0.0.1:1"], "--coordinator needs --num-processes N and --process-id I"),
    (["--num-processes", "2", "--process-id", "0"], "go with --coordinator HOST:PORT"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"], "needs --mesh"),
    (["--mesh", "tp=2", "--coordinator", "127.0.0.1:1", "--num-processes", "1", "--process-id", "0"],
     "--num-processes must be >= 2"),
    (["--mesh", "tp=2", "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in 0..1"),
])
def test_group_flags_are_checked_before_joining(capsys, args, message):
    from jfire.cli import main

    assert main(["generate", "--prompt-ids", "1,2", *args]) == 2
    assert message in capsys.readouterr().err
