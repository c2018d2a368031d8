"""The host-memory tier under the prefix cache (jfire.host_tier): blocks the device pool
evicts are kept in host memory and loaded back for a prompt that shares them, with the same
greedy tokens as computing them; a corrupt host block is computed again, never served, and so
is a block of another model (keyed by the model's identity) or of another page layout. And
block hashes that take extra keys."""

from __future__ import annotations

import numpy as np
import pytest

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.host_tier import HostBlock, HostPrefixCache, HostTier, model_identity
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
        stats = engine.stats()
        assert stats["host_blocks_loaded"] == 10
        block_bytes = tier.cache.get(block_hashes(target, PAGE)[0]).nbytes
        assert stats["host_bytes_loaded"] == 10 * block_bytes and stats["host_bytes_saved"] >= 10 * block_bytes

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


def test_an_entry_of_another_model_or_layout_is_never_served(tiny_model, tiny_hf_dir):
    """One host store under engines of two models of the same config (other weights): the
    blocks one computed are found again by a restart of the same model, never by the other,
    whose prompt of equal token ids is computed (its own greedy tokens); a block whose arrays
    are not the engine's page layout is dropped before it is written in."""
    other_model = load_model(str(tiny_hf_dir("llama2", seed=1)), "float32")
    target, *others = prompts(tiny_model)
    hashes = block_hashes(target, PAGE)  # 10 full blocks, the same for both models
    with Engine(other_model, EngineConfig(num_pages=256, prefix_caching=False, **LIMITS)) as plain:
        expected_other = plain.generate([(target, GREEDY)])[0].token_ids
    store = HostPrefixCache(64 << 20)
    first = HostTier(store=store)
    with Engine(tiny_model, EngineConfig(num_pages=26, **LIMITS), first) as engine:
        expected = engine.generate([(target, GREEDY)])[0].token_ids
        for other in others:  # evict the target's blocks into the store
            engine.generate([(other, GREEDY)])
    assert all(h in first.cache for h in hashes)

    tier = HostTier(store=store)
    with Engine(other_model, EngineConfig(num_pages=26, **LIMITS), tier) as engine:
        assert tier.cache.identity != first.cache.identity
        assert not any(h in tier.cache for h in hashes)  # equal token ids, another model: no match
        # A page of another layout (other heads) under the target's first hash: dropped, not written in.
        saved = store.get(first.cache.identity + hashes[0])
        wrong = [np.zeros((*a.shape[:-1], a.shape[-1] // 2), a.dtype) for a in saved.arrays]
        tier.cache.put(hashes[0], HostBlock(wrong, 0))
        outputs = list(engine.submit(target, GREEDY))
        assert [t for o in outputs for t in o.token_ids] == expected_other != expected
        assert outputs[-1].prefix_hit_tokens == 0
        stats = engine.stats()
        assert (stats["host_blocks_loaded"], stats["host_blocks_corrupt"], stats["pages_used"]) == (0, 1, 0)

    again = HostTier(store=store)  # the first model again (a restart): its blocks are its own
    with Engine(tiny_model, EngineConfig(num_pages=26, **LIMITS), again) as engine:
        assert again.cache.identity == first.cache.identity == model_identity(engine)
        outputs = list(engine.submit(target, GREEDY))
        assert [t for o in outputs for t in o.token_ids] == expected
        assert outputs[-1].prefix_hit_tokens == 40 and engine.stats()["host_blocks_loaded"] == 10


def test_reuse_gating_keeps_only_blocks_that_served_enough_prompts(tiny_model):
    """With min_uses 2, a prompt run once and evicted leaves nothing in host memory (it is
    computed again); run twice (the second found it on the device) and evicted, it comes back
    from host memory with the same tokens."""
    target, *others = prompts(tiny_model)
    tier = HostTier(capacity_bytes=64 << 20, min_uses=2)
    with Engine(tiny_model, EngineConfig(num_pages=26, **LIMITS), tier) as engine:
        expected = engine.generate([(target, GREEDY)])[0].token_ids
        for other in others:  # evict the target's 10 blocks, each having served one prompt
            engine.generate([(other, GREEDY)])
        assert tier.counts["gated"] >= 10 and tier.counts["saved"] == 0 and len(tier.cache) == 0
        first = list(engine.submit(target, GREEDY))
        second = list(engine.submit(target, GREEDY))  # found on the device: its blocks served two
        assert first[-1].prefix_hit_tokens == 0 and second[-1].prefix_hit_tokens == 40
        for other in others:
            engine.generate([(other, GREEDY)])
        assert tier.counts["saved"] >= 10
        outputs = list(engine.submit(target, GREEDY))
        assert [t for o in outputs for t in o.token_ids] == expected
        assert outputs[-1].prefix_hit_tokens == 40 and engine.stats()["host_blocks_loaded"] == 10
        assert engine.stats()["host_blocks_gated"] == tier.counts["gated"]


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
    proc = run_jfire("serve", "--model", tiny_hf_dir("llama2"), "--port", "0", "--host-kv-gb", "1",
                     "--host-kv-min-uses", "0")
    assert_user_error(proc, "--host-kv-min-uses", "0")


def test_a_prefill_engine_with_a_host_tier_hands_on_what_it_loaded_back(tiny_model):
    """The tier beside a role (jfire.kv_connector.ConnectorStack): a prefill-only engine whose
    evicted prefix comes back from host memory hands the decode engine KV that decodes to the
    colocated engine's tokens."""
    from jfire.disagg.in_process import HostKVStore, InProcessDecode, InProcessPrefill
    from jfire.kv_connector import ConnectorStack

    target, *others = prompts(tiny_model)
    sampled = SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True)
    with Engine(tiny_model, EngineConfig(num_pages=256, prefix_caching=False, **LIMITS)) as plain:
        expected = plain.generate([(target, sampled)])[0].token_ids
    store, tier = HostKVStore(), HostTier(capacity_bytes=64 << 20)
    with Engine(tiny_model, EngineConfig(num_pages=26, **LIMITS), ConnectorStack(InProcessPrefill(store), tier)) as p, \
            Engine(tiny_model, EngineConfig(num_pages=64, **LIMITS), InProcessDecode(store)) as d:
        def run(ids, rid):
            first = list(p.submit(ids, sampled, request_id=rid))[-1]
            kv = {"first_token": first.token_ids[0], "transfer": first.transfer}
            return d.submit(ids, sampled, request_id=rid, kv_params=kv).result().token_ids, first.prefix_hit_tokens

        assert run(target, "t0") == (expected, 0)
        for i, other in enumerate(others):
            run(other, f"o{i}")
        assert run(target, "t1") == (expected, 40)
        assert p.stats()["host_blocks_loaded"] == 10 and p.stats()["pages_used"] == 0


def test_a_launch_hands_its_prefill_groups_the_host_tier(monkeypatch):
    """`jfire launch --host-kv-gb` reaches each group process (which builds the tier for a
    prefill group of one process); a deployment whose prefill group spans processes is refused
    up front."""
    from jfire import cli
    from jfire.disagg import launch
    from tests.test_cli import assert_user_error, run_jfire

    seen = {}

    def launch_local(deployment, deployment_arg, options, secret):  # records what each process would be given
        seen["options"] = options
        return 0

    monkeypatch.setattr(launch, "launch_local", launch_local)
    assert cli.main(["launch", "local-1p1d", "--host-kv-gb", "0.5", "--host-kv-min-uses", "2",
                     "--compile-cache", "off"]) == 0
    assert seen["options"].host_kv_bytes == 1 << 29 and seen["options"].host_kv_min_uses == 2
    group = cli.build_parser().parse_args(launch.process_argv("local-1p1d", 1, "127.0.0.1:9", seen["options"]))
    assert group.host_kv_gb == 0.5 and group.host_kv_min_uses == 2
    assert_user_error(run_jfire("launch", "local-groups-2x2", "--host-kv-gb", "1"), "--host-kv-gb", "span")
