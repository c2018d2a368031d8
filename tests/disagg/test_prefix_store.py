"""The prefix store shared by prefill groups (jfire.disagg.prefix_store), between two engines in
one process: blocks one engine computed (on its device, or already moved to its host tier) go
over the wire format to the other, whose prefill then starts after them with the same greedy
tokens as computing them; a block damaged on the way is computed again, never served. The
frontend's side (which group to fetch from) is tests/disagg/test_deployment.py's."""

from __future__ import annotations

import numpy as np

from jfire.disagg.prefix_store import SharedPrefixes, decode_blocks, encode_blocks
from jfire.engine import Engine, EngineConfig
from jfire.host_tier import HostTier
from jfire.kv_cache import block_hashes
from jfire.kv_connector import ConnectorStack, KVConnector
from tests.test_host_tier import GREEDY, LIMITS, PAGE, tiny_model  # noqa: F401 - the fixture, shared


def group(model, num_pages: int):
    """An engine as a prefill group with a host tier builds it: the tier and the shared store."""
    tier = HostTier(capacity_bytes=64 << 20)
    shared = SharedPrefixes(tier)
    return Engine(model, EngineConfig(num_pages=num_pages, **LIMITS), ConnectorStack(KVConnector(), tier, shared)), shared


def test_blocks_computed_by_one_group_serve_another(tiny_model):
    rng = np.random.default_rng(7)
    session, *others = ([int(x) for x in rng.integers(3, tiny_model.config.vocab_size, size=41)] for _ in range(4))
    hashes = block_hashes(session, PAGE)  # 10 full blocks
    holder, holder_store = group(tiny_model, num_pages=26)
    taker, taker_store = group(tiny_model, num_pages=64)
    with holder, taker:
        assert holder_store.identity == taker_store.identity  # one model: they may lend each other blocks
        expected = holder.generate([(session, GREEDY)])[0].token_ids
        # On the holder's device: all 10 blocks, in order, with the sums the device computed.
        exported = holder_store.export(hashes).result(timeout=30).to_host()
        assert [h for h, _ in exported] == hashes
        # Other prompts push them out to the holder's host tier (13 pages a request, 26 in the
        # pool): served from there too.
        for other in others:
            holder.generate([(other, GREEDY)])
        assert holder_store.host.counts["saved"] >= 10
        again = holder_store.export(hashes + [b"\0" * 16]).result(timeout=30).to_host()
        assert [h for h, _ in again] == hashes  # the leading run it holds, and no further
        assert [b.page_sum for _, b in again] == [b.page_sum for _, b in exported]

        taker_store.receive(decode_blocks(encode_blocks(exported)))
        outputs = list(taker.submit(session, GREEDY))
        assert [t for o in outputs for t in o.token_ids] == expected
        assert outputs[-1].prefix_hit_tokens == 40  # every full block came from the holder
        assert taker.stats()["shared_blocks_received"] == 10 and taker.stats()["host_blocks_loaded"] == 10

        # A block damaged on the way is computed again, with every block after it.
        damaged = decode_blocks(encode_blocks(exported))
        damaged[3][1].arrays[0].flat[0] += 1.0
        fresh, fresh_store = group(tiny_model, num_pages=64)
        with fresh:
            fresh_store.receive(damaged)
            outputs = list(fresh.submit(session, GREEDY))
            assert [t for o in outputs for t in o.token_ids] == expected
            assert outputs[-1].prefix_hit_tokens == 3 * PAGE
            assert fresh.stats()["host_blocks_corrupt"] == 1
            assert fresh.stats()["pages_used"] == 0
        assert holder.stats()["pages_used"] == 0 and taker.stats()["pages_used"] == 0
