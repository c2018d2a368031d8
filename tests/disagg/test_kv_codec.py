"""The KV pages' wire code (jfire.disagg.kv_codec): every page decodes to its source bits, in
bfloat16 and float32, zeros, subnormals, signed zeros and escapes included; a tile with more
escapes than it has room for is reported (its transfer then goes raw), never coded wrong."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfire.disagg import kv_codec

encode = jax.jit(kv_codec.encode)
decode = jax.jit(kv_codec.decode, static_argnums=(1, 2))


def pages(dtype, rng, shape=(2, 3, 2, 16, 64)) -> np.ndarray:
    """[layers, heads, pages, page_slots, head_dim] like a cache: per-channel scales, then a
    last page's unfilled slots (zeros), a few tiny values and signed zeros."""
    x = rng.standard_normal(shape) * np.exp(0.5 * rng.standard_normal(shape[:2] + (1, 1, shape[-1])))
    x[:, :, -1, 9:] = 0
    x[0, 0, 0, 3, :3] = [1e-30, -1e-39, -0.0]  # escapes (far below the tile's top), a subnormal, -0
    return x.astype(dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_pages_decode_to_their_source_bits(dtype):
    x = pages(dtype, np.random.default_rng(0))
    coded, overflow = encode(jnp.asarray(x))
    assert not bool(overflow)
    assert coded.dtype == jnp.uint8 and coded.shape == x.shape[:-2] + (1, kv_codec.coded_width((16, 64), dtype))
    assert coded.shape[1:] == kv_codec.coded_shape(x.shape[1:], dtype)  # page by page as a whole stack
    assert same_bits(np.asarray(decode(coded, (16, 64), dtype)), x)
    # A page coded alone is the same bytes as that page of the stack.
    alone, _ = encode(jnp.asarray(x[:, :, 1]))
    assert np.array_equal(np.asarray(alone), np.asarray(coded)[:, :, 1])
    # bfloat16: 1 + 16 + 512 + 1024 bytes per 2048; float32: 1 + 16 + 512 + 3072 per 4096.
    assert coded.nbytes / x.nbytes == pytest.approx(1553 / 2048 if dtype == ml_dtypes.bfloat16 else 3601 / 4096)


def test_odd_tiles_and_tiles_of_zeros_and_specials():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 5)).astype(ml_dtypes.bfloat16)  # 15 values a tile: codes padded to a byte
    x[1] = 0
    x[2, 0, :2] = [np.inf, -np.inf]  # the top is then 255: every finite value escapes
    x[2, 0, 2:], x[2, 1:] = [0, 1.5, 0], 0
    x[3, 0, 0] = np.nan
    x[3, 0, 1:], x[3, 1:] = 0, 0
    coded, overflow = encode(jnp.asarray(x))
    assert not bool(overflow)  # one escape fits a tile of 15 (the finite value beside the infinities)
    assert same_bits(np.asarray(decode(coded, (3, 5), ml_dtypes.bfloat16)), x)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_a_tile_with_more_escapes_than_room_is_reported(dtype):
    rng = np.random.default_rng(2)
    x = pages(dtype, rng, (1, 1, 2, 16, 64))
    cap = kv_codec.escape_capacity(16 * 64)
    tiny = np.float32(2.0**-40)
    flat = rng.uniform(1, 2, 16 * 64).astype(dtype)  # page 1: one exponent, no escapes of its own
    flat[:cap] = tiny  # exactly as many escapes as there is room for: still coded, exactly
    x[0, 0, 1] = flat.reshape(16, 64)
    coded, overflow = encode(jnp.asarray(x))
    assert not bool(overflow) and same_bits(np.asarray(decode(coded, (16, 64), dtype)), x)
    flat[cap] = tiny  # one more
    x[0, 0, 1] = flat.reshape(16, 64)
    assert bool(encode(jnp.asarray(x))[1])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_transfer_programs_move_pages_coded_and_fall_back_to_raw(dtype):
    """The gather and insert programs of a coded deployment, between two page pools: pages
    arrive bit for bit with the sender's checksum, coded; a page holding an infinity (every
    finite value of its tile then escapes) makes its transfer go raw, and it arrives the same."""
    from jfire.disagg.kv_transfer import KVLayout, TransferPrograms
    from jfire.kv_cache import init_pages
    from jfire.models.llama import LlamaConfig

    cfg = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                      rope_theta=10000.0)
    layout = KVLayout(cfg, 1, 16, dtype, None)
    rng = np.random.default_rng(3)
    sender = {k: jnp.asarray(rng.standard_normal(v.shape).astype(np.float32)).astype(dtype)
              for k, v in init_pages(cfg, 6, 16, dtype).items()}
    gather = TransferPrograms(layout, sender, (2, 4), "gather", coded=True)
    insert = TransferPrograms(layout, init_pages(cfg, 6, 16, dtype), (2, 4), "insert", coded=True)
    gather.compile_all()
    insert.compile_all()

    def move(pages, sent_ids, into_ids):
        arrays, coded, sent = gather.gather_coded(pages, sent_ids)
        received, arrived = insert.insert(init_pages(cfg, 6, 16, dtype), arrays, into_ids, coded)
        assert arrived == sent
        for c in layout.arrays:
            got = np.take(np.asarray(received[c.name]), into_ids, axis=c.pages_axis)
            want = np.take(np.asarray(pages[c.name]), sent_ids, axis=c.pages_axis)
            assert same_bits(got, want)
        return coded, sum(a.nbytes for a in arrays)

    coded, nbytes = move(sender, [4, 1, 2], [0, 5, 3])
    assert coded and nbytes == 3 * sum(kv_codec.coded_width((16, 8), dtype) * 2 * 2 for _ in layout.arrays)
    sender["k"] = sender["k"].at[1, 0, 2, 0, 0].set(jnp.inf)  # layer 1, head 0, page 2
    coded, nbytes = move(sender, [4, 1, 2], [0, 5, 3])
    assert not coded and nbytes == 3 * layout.page_nbytes
