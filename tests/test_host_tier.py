"""The host-memory tier under the prefix cache (jfire.host_tier): blocks the device pool
evicts are kept in host memory and loaded back for a prompt that shares them, with the same
greedy tokens as computing them; a corrupt host block is computed again, never served. And
block hashes that take extra keys."""

from __future__ import annotations

import numpy as np
import pytest

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.host_tier import HostTier
from jfire.kv_cache import block_hashes
from jfire.sampling import SamplingParams

PAGE = 4
LIMITS = dict(page_size=PAGE, max_batch=2, prefill_budget=32, max_prefill_rows=2, max_model_len=96, aot=False,
              quick_compile=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tiny_hf_dir):
    return load_model(str(tiny_hf_dir("llama2")), "float32")


def prompts(model):
    rng = np.random.default_rng(5)
    return [[int(x) for x in rng.integers(3, model.config.vocab_size, size=41)] for _ in range(4)]


def test_evicted_prefixes_come_back_from_host_memory(tiny_model):
    target, *others = prompts(tiny_model)
    with Engine(tiny_model, EngineConfig(num_pages=256, prefix_caching=False, **LIMITS)) as plain:
        expected = plain.generate([(target, GREEDY)])[0].token_ids
    tier = HostTier(capacity_bytes=64 << 20)
    # 13 pages a request: the pool holds two, so the others evict the target's blocks.
    with Engine(tiny_model, EngineConfig(num_pages=26, **LIMITS), tier) as engine:
        assert engine.generate([(target, GREEDY)])[0].token_ids == expected
        for other in others:
            engine.generate([(other, GREEDY)])
        assert tier.counts["saved"] >= 10  # the target's 10 full blocks left the device
        handle = engine.submit(target, GREEDY)
        outputs = list(handle)
        assert [t for o in outputs for t in o.token_ids] == expected
        assert outputs[-1].prefix_hit_tokens == 40  # every full block but the prompt's last token
        assert engine.stats()["host_blocks_loaded"] == 10

        # A block corrupted in host memory is computed again (and the ones after it).
        for other in others:  # these come back from host memory too, and evict the target again
            engine.generate([(other, GREEDY)])
        loaded = engine.stats()["host_blocks_loaded"]
        first = tier.cache.get(block_hashes(target[:PAGE], PAGE)[0])
        first.arrays[0] = first.arrays[0].copy()
        first.arrays[0].flat[0] += 1.0
        outputs = list(engine.submit(target, GREEDY))
        assert [t for o in outputs for t in o.token_ids] == expected
        assert outputs[-1].prefix_hit_tokens == 0
        assert engine.stats()["host_blocks_corrupt"] == 1 and engine.stats()["host_blocks_loaded"] == loaded
        assert engine.stats()["pages_used"] == 0


def test_block_hashes_take_extra_keys():
    tokens = list(range(12))
    plain = block_hashes(tokens, 4)
    assert block_hashes(tokens, 4) == plain  # stable
    salted = block_hashes(tokens, 4, salt=b"tenant-a")
    assert all(a != b for a, b in zip(plain, salted)) and salted != block_hashes(tokens, 4, salt=b"tenant-b")
    # An image in block 1 changes that block's hash and every later one, not the earlier ones.
    image = block_hashes(tokens, 4, extra_keys=lambda start, end: b"image:1f2e" if start <= 5 < end else b"")
    assert image[0] == plain[0] and image[1] != plain[1] and image[2] != plain[2]


def test_a_negative_host_tier_is_refused_in_one_line(tiny_hf_dir):
    from tests.test_cli import assert_user_error, run_jfire

    proc = run_jfire("serve", "--model", tiny_hf_dir("llama2"), "--port", "0", "--host-kv-gb", "-1")
    assert_user_error(proc, "--host-kv-gb", "-1")
