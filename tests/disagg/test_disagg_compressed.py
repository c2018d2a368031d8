"""KV transfers coded on the wire (`[transfer] compress = true`): `jfire launch` of a
deployment whose groups are tensor-parallel over 2 devices each (a tiny Llama in bfloat16, so
its KV cache is bfloat16, and its 2 KV heads travel split over 2 devices). Outputs equal
colocated generation on the same mesh; every page arrives with the sender's checksum of its raw
values (the code is lossless, or the request would fail); the bytes on the wire are at most 0.8
of the cache's, and both are reported."""

from __future__ import annotations

import httpx
import jax
import jax.numpy as jnp
import openai
import pytest

from jfire.checkpoint import store
from jfire.models.llama import LlamaConfig
from jfire.models.params import init_params
from tests.disagg.deployment_process import assert_quiet, greedy_tokens, launched, metric

MODEL = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                    rope_theta=10000.0)
MODEL_NAME = "tiny-kv"
PAGE_BYTES = 2 * 2 * 2 * 16 * 16 * 2  # [k, v] x layers x KV heads x page slots x head dim, bfloat16
MESH = ["--dtype", "bfloat16", "--quick-compile"]
PROMPTS = [{"prompt_ids": [1, 5, 9, 200, 31], "max_tokens": 8},
           {"prompt_ids": list(range(3, 60)), "max_tokens": 10},
           {"prompt_ids": [7, 7, 7] * 12, "max_tokens": 6}]
DEPLOYMENT = """name = "compressed-1p1d"
[coordinator]
port = 0
[transfer]
timeout_s = 10
compress = true
[[groups]]
name = "prefill-0"
role = "prefill"
mesh = "tp=2"
devices_per_process = 2
[[groups]]
name = "decode-0"
role = "decode"
mesh = "tp=2"
devices_per_process = 2
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kv")
    store.save(path, MODEL, init_params(MODEL.param_specs(), jax.random.key(3), jnp.float32, scale=0.1), "float32")
    return path


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """The prompts' greedy tokens from colocated `jfire generate` on the same mesh and dtype."""
    return greedy_tokens(model, PROMPTS, tmp_path_factory.mktemp("reference"), "--mesh", "tp=2", "--cpu-devices",
                         "2", *MESH)


@pytest.fixture(scope="module")
def deployment(model, tmp_path_factory):
    extra = ("--model", str(model), "--served-model-name", MODEL_NAME, *MESH)
    with launched(tmp_path_factory.mktemp("compressed"), "compressed", DEPLOYMENT, extra) as running:
        yield running
    assert_quiet(running.log)


def complete(url: str, prompt: dict) -> list[int]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = c.completions.create(model=MODEL_NAME, prompt=prompt["prompt_ids"], max_tokens=prompt["max_tokens"],
                               temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    return [int(t) for t in out.choices[0].logprobs.tokens]


def group_stats(deployment, name: str) -> dict:
    return httpx.get(deployment.health["groups"][name]["control"] + "/stats", headers=deployment.control_auth,
                     timeout=5).json()


def test_coded_transfers_give_colocated_tokens_in_fewer_bytes(deployment, reference):
    assert deployment.health["groups"]["decode-0"]["kv_shards"] == 2  # the wire splits over heads
    for prompt, expected in zip(PROMPTS, reference):
        assert complete(deployment.url, prompt) == expected
    cache = sum(-(-len(p["prompt_ids"]) // 16) for p in PROMPTS) * PAGE_BYTES  # the prompts' whole pages
    prefill, decode = group_stats(deployment, "prefill-0"), group_stats(deployment, "decode-0")
    assert (prefill["transfers_coded"], prefill["transfers_sent_raw"]) == (len(PROMPTS), 0)
    assert (decode["kv_transfers"], decode["transfers_corrupted"], decode["transfers_failed"]) == (len(PROMPTS), 0, 0)
    assert decode["kv_transfer_raw_bytes"] == cache
    assert decode["kv_transfer_bytes"] <= 0.8 * cache
    # The frontend reports both, and the same.
    assert metric(deployment.url, "jfire_kv_transfer_raw_bytes_total") == cache
    assert metric(deployment.url, "jfire_kv_transfer_bytes_total") == decode["kv_transfer_bytes"]
