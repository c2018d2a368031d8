"""A disaggregated deployment whose groups span processes: prefill tensor-parallel over 2
processes x 2 devices, decode a 2-stage pipeline over 2 processes x 1 device (`jfire launch`,
5 OS processes). Each process sends or pulls only its own blocks of the KV cache (its heads on
the prefill side, its layers on the decode side), the outputs equal one device's, and a group
that loses a process goes down whole and comes back."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import jax
import jax.numpy as jnp
import openai
import pytest

from jfire.checkpoint import store
from jfire.models.llama import LlamaConfig
from jfire.models.params import init_params
from tests.disagg.deployment_process import assert_quiet, greedy_tokens, launched, wait_for

# 16 heads over tp=4, 8 layers over pp=2.
MODEL = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                    num_layers=8, num_heads=16, num_kv_heads=8, head_dim=8, max_position_embeddings=512,
                    rope_theta=10000.0, qkv_bias=True)
PAGE_BYTES = 2 * 8 * 8 * 16 * 8 * 4  # [k, v] x layers x KV heads x page slots x head dim, float32
PROMPTS = [{"prompt_ids": [1, 5, 9, 200, 31], "max_tokens": 8},
           {"prompt_ids": list(range(3, 40)), "max_tokens": 10},
           {"prompt_ids": [7, 7, 7], "max_tokens": 6}]
DEPLOYMENT = """name = "groups-2x2"
[coordinator]
port = 0
[transfer]
timeout_s = 10
[[groups]]
name = "prefill-0"
role = "prefill"
mesh = "tp=4"
processes = 2
devices_per_process = 2
[[groups]]
name = "decode-0"
role = "decode"
mesh = "pp=2"
processes = 2
devices_per_process = 1
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny16")
    store.save(path, MODEL, init_params(MODEL.param_specs(), jax.random.key(0), jnp.float32, scale=0.1), "float32")
    return path


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """The prompts' greedy tokens from colocated `jfire generate` on one device."""
    return greedy_tokens(model, PROMPTS, tmp_path_factory.mktemp("reference"), "--quick-compile")


@pytest.fixture(scope="module")
def deployment(model, tmp_path_factory):
    extra = ("--model", str(model), "--max-restarts", "1", "--served-model-name", MODEL_NAME, "--quick-compile")
    with launched(tmp_path_factory.mktemp("groups"), "groups", DEPLOYMENT, extra) as running:
        yield running
    assert_quiet(running.log)  # four processes joined gloo groups, each restarted group again


def complete(url: str, prompt: dict, **extra) -> list[int]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = c.completions.create(model=MODEL_NAME, prompt=prompt["prompt_ids"], max_tokens=prompt["max_tokens"],
                               temperature=0, logprobs=1, extra_body={"ignore_eos": True}, **extra)
    return [int(t) for t in out.choices[0].logprobs.tokens]


MODEL_NAME = "tiny16"


def group_stats(deployment, name: str) -> dict:
    health = httpx.get(deployment.url + "/health", headers=deployment.control_auth, timeout=5).json()
    return httpx.get(health["groups"][name]["control"] + "/stats", headers=deployment.control_auth, timeout=5).json()


def kv_bytes_moved(deployment) -> tuple[dict, dict, int]:
    """(bytes sent by each prefill process, bytes pulled by each decode process, bytes the
    decode group received) so far."""
    prefill, decode = group_stats(deployment, "prefill-0"), group_stats(deployment, "decode-0")
    return prefill["kv_bytes_sent_by_process"], decode["kv_bytes_pulled_by_process"], decode["kv_transfer_bytes"]


def test_groups_spanning_processes_equal_one_device_and_move_only_their_own_blocks(deployment, reference):
    # Counted from here: the module's other tests may have run first (and restarted the decode group).
    sent_before, pulled_before, received_before = kv_bytes_moved(deployment)
    for prompt, expected in zip(PROMPTS, reference):
        assert complete(deployment.url, prompt) == expected
    cache = sum(-(-len(p["prompt_ids"]) // 16) for p in PROMPTS) * PAGE_BYTES  # the prompts' whole pages
    sent, pulled, received = kv_bytes_moved(deployment)
    # Prefill processes 1 and 2 each hold half the heads; decode processes 3 and 4 half the layers.
    assert {p: n - sent_before.get(p, 0) for p, n in sent.items()} == {"1": cache // 2, "2": cache // 2}
    assert {p: n - pulled_before.get(p, 0) for p, n in pulled.items()} == {"3": cache // 2, "4": cache // 2}
    assert received - received_before == cache


def test_killing_a_follower_takes_its_group_down_and_back(deployment, reference):
    follower = int(re.search(r"process 4 decode-0/1 \(1 devices\): pid (\d+)", deployment.log.read_text()).group(1))
    c = openai.OpenAI(base_url=deployment.url + "/v1", api_key="none", max_retries=0)
    stream = iter(c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0]["prompt_ids"], max_tokens=300,
                                       temperature=0, logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    next(stream)  # decoding
    os.kill(follower, signal.SIGSTOP)  # the group stalls at its next collective: mid-stream for sure
    os.kill(follower, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError) as failure:
        for _ in stream:
            pass
    assert time.monotonic() - killed < 10
    # The leader's collective fails at once ("engine failure (in a group spanning processes)"),
    # or the frontend sees the group's stream break first.
    assert "group spanning processes" in str(failure.value) or "decode-0" in str(failure.value)
    # The launcher stops the group's leader too and starts both again; the prefill group kept
    # serving and holds no pages for the lost request (its transfer was acknowledged).
    wait_for(lambda: "restarting decode-0" in deployment.log.read_text(), 30, "the decode group's restart")
    assert group_stats(deployment, "prefill-0")["pages_used"] == 0

    def back():
        try:
            return complete(deployment.url, PROMPTS[1]) == reference[1]
        except openai.APIError:
            return False

    wait_for(back, 300, "the restarted decode group serving again")
