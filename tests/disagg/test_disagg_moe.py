"""A mixture-of-experts model with latent attention through the unchanged serving paths: a
tiny DeepSeek-V3 (multi-head latent attention over the latent paged cache, a dense first
layer, grouped routing, shared experts) served by `jfire serve` and by a real
`jfire launch local-1p1d` deployment, each equal to colocated `jfire generate`, with the
cache bytes moved equal to the prompts' latent size computed from config.json."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

import pytest

from tests.disagg.clients import assert_same_as_colocated
from tests.disagg.deployment_process import colocated, deployment_file, launch, metric
from tests.limits import SERVE_LIMITS
from tests.serve.server_process import start_server
from tests.tiny_models import save_byte_tokenizer, save_tiny_hf_model

PROMPTS = [
    {"prompt": "The capital of France is", "max_tokens": 12},
    {"prompt": "Write a short poem about the sea and the wind. " * 2, "max_tokens": 16},
    {"prompt": "List three prime numbers: 2, 3,", "max_tokens": 10},
]
# The tiny model compiles quickly (it runs a few tokens): the reference, the server and the groups alike.
QUICK = ("--quick-compile",)
SMALL = (*SERVE_LIMITS, *QUICK, "--served-model-name", "default")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-v3")
    save_tiny_hf_model("deepseek_v3", path)
    return str(save_byte_tokenizer(path))


@pytest.fixture(scope="module")
def reference(moe_dir, tmp_path_factory):
    return colocated(PROMPTS, tmp_path_factory.mktemp("colocated-moe"), model=moe_dir, engine_args=QUICK)


def test_serve_equals_generate(moe_dir, reference, tmp_path):
    server = start_server(["--model", moe_dir, *SMALL], tmp_path / "serve.log")
    try:
        assert_same_as_colocated(server.url, PROMPTS, reference)
    finally:
        server.stop()


def test_launch_1p1d_equals_generate(moe_dir, reference, tmp_path):
    running = launch(deployment_file(tmp_path, "local-1p1d", timeout_s=30), tmp_path / "launch.log",
                     extra=("--model", moe_dir, "--served-model-name", "default", *QUICK))
    try:
        lengths = assert_same_as_colocated(running.url, PROMPTS, reference)
        hf = json.loads((Path(moe_dir) / "config.json").read_text())
        # Per token and layer only the latent and the rope key (float32), for each of a page's
        # 16 slots: never per-head keys and values.
        page = hf["num_hidden_layers"] * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * 4 * 16
        assert metric(running.url, "jfire_kv_transfer_bytes_total") == sum(-(-n // 16) * page for n in lengths)
        assert_stop_drains_in_flight_requests(running)
    finally:
        code = running.stop()
    assert code == 0, running.log.read_text()[-3000:]


def assert_stop_drains_in_flight_requests(running):
    """Ctrl-C on `jfire launch` with a stream open: the frontend goes on answering while it
    drains: new requests get 503 and /health says "draining", the open stream runs to its end
    through the groups ([DONE] and every token), and the launcher exits 0 after. The decode
    group is frozen for the first moments of the drain: the tiny model would otherwise finish
    its tokens, and the frontend stop, before the drain could be observed."""
    body = {"model": "default", "prompt": "Tell me a long story.", "max_tokens": 230, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks, done = [], threading.Event()
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", running.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    break
            decode_pid = running.group("decode")["pid"]
            os.kill(decode_pid, signal.SIGSTOP)
            try:
                stopper = threading.Thread(target=lambda: (running.stop(), done.set()))
                stopper.start()
                # Kept short: a group frozen past the cluster's 10 s heartbeat would be declared dead.
                deadline = time.monotonic() + 8
                while httpx.get(running.url + "/health", timeout=5).json().get("status") != "draining":
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                refused = httpx.post(running.url + "/v1/completions", json={**body, "stream": False}, timeout=5)
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            finally:
                os.kill(decode_pid, signal.SIGCONT)
            for line in lines:
                if line == "data: [DONE]":
                    chunks.append("[DONE]")
                elif line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
    assert chunks[-1] == "[DONE]"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c.get("choices")]
    assert finishes[-1] == "length"  # all 230 tokens, not cut short
    stopper.join(120)
    assert done.is_set()
