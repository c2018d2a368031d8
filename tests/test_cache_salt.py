"""Per-request cache salts: prompts reuse cached blocks only of prompts with the same salt, so
`usage.prompt_tokens_details.cached_tokens` never tells a client what a client of another salt
(or of another API key, with per-key salts) sent; what a salted prompt generates is exactly
what it generates unsalted. The host tier keys blocks by the same salted hashes, and the
frontend's prefix index and the groups hash alike, the salt travelling in SamplingParams."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from jfire.checkpoint.load import load_model
from jfire.disagg.prefix_index import PrefixIndex
from jfire.engine import Engine, EngineConfig
from jfire.errors import RequestError
from jfire.host_tier import HostTier
from jfire.kv_cache import block_hashes
from jfire.sampling import MAX_CACHE_SALT_CHARS, SamplingParams
from serve import api_keys
from serve.app import ServerState, create_app

PAGE = 4
# 26 pages hold two requests of 13 (41 prompt tokens and 8 generated): a third evicts one.
LIMITS = dict(page_size=PAGE, max_batch=2, prefill_budget=32, max_prefill_rows=2, max_model_len=96, aot=False,
              quick_compile=True, num_pages=26)
CACHED = 40  # a 41-token prompt's full blocks: every token but the last, whose logits are needed
KEYS = ("tenant-one-key", "tenant-two-key")


@pytest.fixture(scope="module")
def tiny_model(tiny_hf_dir):
    return load_model(str(tiny_hf_dir("llama2")), "float32")


@pytest.fixture(scope="module")
def engine(tiny_model):
    tier = HostTier(capacity_bytes=64 << 20)
    with Engine(tiny_model, EngineConfig(**LIMITS), tier) as engine:
        engine.tier = tier
        yield engine


def prompts(model, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, model.config.vocab_size, size=CACHED + 1)] for _ in range(n)]


def complete(http: TestClient, prompt: list[int], key: str | None = None, **fields) -> tuple[list[int], int]:
    """(generated ids, cached prompt tokens) of a greedy completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **fields}
    r = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_salts_share_no_cached_tokens_and_change_no_output(engine, tiny_model):
    prompt, = prompts(tiny_model, 1, seed=11)
    http = TestClient(create_app(ServerState(engine, "m", access_log=False)))
    first, cached = complete(http, prompt, cache_salt="tenant-a")
    assert cached == 0
    assert complete(http, prompt, cache_salt="tenant-a") == (first, CACHED)  # the same salt: its prefix
    assert complete(http, prompt, cache_salt="tenant-b") == (first, 0)  # another salt: nothing of it
    assert complete(http, prompt) == (first, 0)  # no salt: nothing of either
    assert complete(http, prompt, cache_salt="tenant-b") == (first, CACHED)
    assert complete(http, prompt) == (first, CACHED)


def test_each_api_key_hashes_apart_and_its_salt_is_not_the_key(engine, tiny_model, monkeypatch):
    prompt, = prompts(tiny_model, 1, seed=12)
    state = ServerState(engine, "m", api_keys=KEYS, access_log=False, cache_salt_per_key=True)
    http = TestClient(create_app(state))
    salts = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda ids, sampling, **kw: salts.append(sampling.cache_salt) or submit(
        ids, sampling, **kw))
    first, cached = complete(http, prompt, KEYS[0])
    assert cached == 0
    assert complete(http, prompt, KEYS[0]) == (first, CACHED)
    assert complete(http, prompt, KEYS[1]) == (first, 0)
    # A client's own salt splits its key's cache further, and cannot reach into another key's.
    assert complete(http, prompt, KEYS[0], cache_salt="x") == (first, 0)
    assert complete(http, prompt, KEYS[1], cache_salt="x") == (first, 0)
    assert complete(http, prompt, KEYS[1], cache_salt=salts[0]) == (first, 0)
    assert complete(http, prompt, KEYS[1]) == (first, CACHED)
    assert len(set(salts)) == 5 and salts[0] == salts[1] and salts[2] == salts[-1]
    assert not any(key in salt for key in KEYS for salt in salts)
    assert salts[0] == api_keys.salt_for(state.salt_key, KEYS[0], None)


def test_the_host_tier_keeps_salted_blocks_apart(engine, tiny_model):
    """Blocks evicted to host memory come back for a prompt of their salt only."""
    target, *others = prompts(tiny_model, 4, seed=13)
    salted = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, cache_salt="tenant-a")
    other_salt = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, cache_salt="tenant-b")
    expected = engine.generate([(target, salted)])[0].token_ids
    # Three more: the second's pages are the target's, which the third's steps save to host memory.
    for other in others:
        engine.generate([(other, salted)])
    assert engine.tier.cache.get(block_hashes(target, PAGE, salt="tenant-a")[0]) is not None
    assert engine.tier.cache.get(block_hashes(target, PAGE)[0]) is None
    loaded = engine.stats()["host_blocks_loaded"]
    outputs = list(engine.submit(target, other_salt))
    assert [t for o in outputs for t in o.token_ids] == expected and outputs[-1].prefix_hit_tokens == 0
    assert engine.stats()["host_blocks_loaded"] == loaded
    for other in others:  # evict again (the other salt's blocks go to host memory too)
        engine.generate([(other, salted)])
    outputs = list(engine.submit(target, salted))
    assert [t for o in outputs for t in o.token_ids] == expected and outputs[-1].prefix_hit_tokens == CACHED
    assert engine.stats()["host_blocks_loaded"] >= loaded + CACHED // PAGE


@pytest.mark.parametrize(("salt", "message"), [
    ("", "cache_salt: a salt is 1 to 256 characters, got 0"),
    ("s" * (MAX_CACHE_SALT_CHARS + 1), "cache_salt: a salt is 1 to 256 characters, got 257"),
    (5, "cache_salt: Input should be a valid string"),
    ("\ud800", "cache_salt is not valid Unicode"),
])
def test_a_salt_that_is_empty_long_or_not_text_answers_400(engine, salt, message):
    http = TestClient(create_app(ServerState(engine, "m", access_log=False)))
    body = json.dumps({"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "cache_salt": salt})
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    assert message in r.json()["error"]["message"]


def test_the_salt_travels_to_the_groups_and_they_hash_as_the_frontend_does():
    sampling = SamplingParams(temperature=0.0, cache_salt="tenant-a")
    assert SamplingParams.from_json(json.loads(json.dumps(sampling.to_json()))).cache_salt == "tenant-a"
    prompt = list(range(3, 43))
    assert PrefixIndex(PAGE).hashes(prompt, None, "tenant-a") == block_hashes(prompt, PAGE, salt=b"tenant-a")
    assert not set(block_hashes(prompt, PAGE, salt="tenant-a")) & set(block_hashes(prompt, PAGE, salt="tenant-b"))
    assert not set(block_hashes(prompt, PAGE, salt="tenant-a")) & set(block_hashes(prompt, PAGE))
    for bad in ("", "s" * (MAX_CACHE_SALT_CHARS + 1), "\ud800", 5):  # a group refuses what no frontend sends
        with pytest.raises(RequestError, match="cache_salt must be 1 to 256 characters"):
            SamplingParams(cache_salt=bad)
