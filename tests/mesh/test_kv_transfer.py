"""The KV wire format between meshes, through JAX's transfer server (this process pulls from
itself): pages gathered on one mesh, moved shard for shard, inserted on another, equal the
original pages bit for bit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import transfer

from jfire import mesh as meshes
from jfire import sharding
from jfire.disagg.kv_transfer import KVLayout, TransferPrograms, new_uuid
from jfire.kv_cache import init_pages
from jfire.models.llama import LlamaConfig

CFG = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=96,
                  num_layers=4, num_heads=6, num_kv_heads=3, head_dim=8, max_position_embeddings=128,
                  rope_theta=10000.0)
PAGE, PAGES = 4, 12
WIDTHS = (4, 8)


def side(spec_text, devices, replication):
    """(layout, pages, programs) of one side; pages hold random values in its own layout."""
    mesh = meshes.build(meshes.MeshSpec.inline(spec_text), devices) if spec_text else None
    cfg = dataclasses.replace(CFG, num_kv_heads=CFG.num_kv_heads * replication)
    pages = init_pages(cfg, PAGES, PAGE, jnp.float32, sharding.cache_shardings(cfg, mesh) if mesh else None)
    return KVLayout(cfg, replication, PAGE, jnp.float32, mesh), pages


@pytest.fixture(scope="module")
def server():
    return transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])


@pytest.mark.parametrize("src_spec, src_devices, src_rep, dst_spec, dst_devices, dst_rep, wire_shards", [
    ("tp=3", range(0, 3), 1, "tp=3", range(3, 6), 1, 3),  # shard for shard over KV heads
    ("tp=6", range(0, 6), 2, None, [6], 1, 1),  # heads repeated for tp=6, sent once, one device
    (None, [0], 1, "pp=2,tp=3", range(2, 8), 1, 1),  # one device -> layers and heads split
])
def test_pages_survive_the_move_between_meshes(server, src_spec, src_devices, src_rep, dst_spec, dst_devices,
                                               dst_rep, wire_shards):
    devices = jax.devices()
    src, src_pages = side(src_spec, [devices[i] for i in src_devices], src_rep)
    dst, dst_pages = side(dst_spec, [devices[i] for i in dst_devices], dst_rep)
    # Random KV, with each repeated head equal to its original as the model writes it.
    rng = np.random.default_rng(0)
    canonical = rng.standard_normal((2, CFG.num_layers, CFG.num_kv_heads, PAGES, PAGE, CFG.head_dim), np.float32)
    full = np.repeat(canonical, src_rep, axis=2)
    src_pages = {"k": jax.device_put(full[0], src_pages["k"].sharding),
                 "v": jax.device_put(full[1], src_pages["v"].sharding)}

    shards = src.usable_shards(dst.preferred_shards())
    assert shards == wire_shards
    gather = TransferPrograms(src, src_pages, WIDTHS, "gather")
    insert = TransferPrograms(dst, dst_pages, WIDTHS, "insert")
    gather.compile_all()
    insert.compile_all()

    sent_ids, received_ids = [7, 2, 9, 4, 0], [1, 5, 3, 11, 8]
    gathered, sent_checksum = gather.gather(src_pages, sent_ids)
    wire = src.to_wire(gathered, shards)
    assert len(wire) == 2 * len(sent_ids)  # one key and one value array per page
    assert len(wire[0].addressable_shards) == shards
    uuid = new_uuid()
    server.await_pull(uuid, wire)
    pulled = server.connect(server.address()).pull(uuid, dst.wire_structs(len(sent_ids), shards))
    assert sum(a.nbytes for a in pulled) == len(sent_ids) * 2 * CFG.num_layers * CFG.num_kv_heads * PAGE * CFG.head_dim * 4
    out, arrived_checksum = insert.insert(dst_pages, pulled, received_ids)
    # Both sides sum the same bits: the sent pages' own (an independent numpy sum here).
    own = sum(int(canonical[:, :, :, s].view(np.uint32).astype(np.uint64).sum()) for s in sent_ids) % (1 << 32)
    assert arrived_checksum == sent_checksum == own

    got_k, got_v = np.asarray(out["k"]), np.asarray(out["v"])
    for s, r in zip(sent_ids, received_ids):
        for h in range(CFG.num_kv_heads * dst_rep):
            np.testing.assert_array_equal(got_k[:, h, r], canonical[0, :, h // dst_rep, s])
            np.testing.assert_array_equal(got_v[:, h, r], canonical[1, :, h // dst_rep, s])
    untouched = sorted(set(range(PAGES)) - set(received_ids))
    assert not got_k[:, :, untouched].any() and not got_v[:, :, untouched].any()
    # A transfer that arrives with a page's bytes stale (zeros here) fails the comparison.
    stale = [jax.numpy.zeros_like(pulled[0]), *pulled[1:]]
    assert insert.insert(out, stale, received_ids)[1] != sent_checksum
