"""The host side of the codec against independent references: code lengths against a plain
(unlimited) Huffman built with heapq, prefix-freeness checked symbol by symbol, the device
checksum against the numpy one."""

from __future__ import annotations

import heapq
import itertools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfire.checkpoint import codec
from jfire.checkpoint.compressed import device_checksum
from jfire.kernels.bf16_decode import CODE_BITS


def huffman_cost(freq) -> int:
    """Total bits of an optimal (unlimited) Huffman code: the sum of all merge weights."""
    heap = [int(f) for f in freq if f]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        cost += merged
        heapq.heappush(heap, merged)
    return cost


@pytest.mark.parametrize("seed", range(5))
def test_code_lengths_are_optimal_when_the_limit_does_not_bind(seed):
    freq = np.zeros(256, np.int64)
    present = np.random.default_rng(seed).choice(256, 20, replace=False)
    freq[present] = np.random.default_rng(seed + 100).integers(1000, 5000, 20)
    lengths = codec.code_lengths(freq)
    assert lengths.max() <= CODE_BITS and codec.kraft_complete(lengths)
    assert int((lengths.astype(np.int64) * freq).sum()) == huffman_cost(freq)


def test_code_lengths_respect_the_limit_when_it_binds():
    freq = np.zeros(256, np.int64)
    freq[:40] = 2 ** np.arange(40, 0, -1)  # geometric: unlimited Huffman would need 39 bits
    lengths = codec.code_lengths(freq)
    assert lengths.max() == CODE_BITS and codec.kraft_complete(lengths)
    assert (lengths[:40] > 0).all() and (lengths[40:] == 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_limited_code_lengths_are_optimal(seed):
    """Against brute force: every complete assignment of lengths 1..4 to 7 symbols."""
    freq = np.zeros(256, np.int64)
    freq[:7] = np.random.default_rng(seed).integers(1, 1000, 7) ** 2
    best = min(
        sum(int(f) * l for f, l in zip(freq[:7], combo))
        for combo in itertools.product(range(1, 5), repeat=7)
        if sum(2.0 ** -l for l in combo) == 1.0
    )
    lengths = codec.code_lengths(freq, max_bits=4)
    assert lengths.max() <= 4 and int((lengths.astype(np.int64) * freq).sum()) == best


@pytest.mark.parametrize("present", [[], [7], [7, 200]])
def test_degenerate_alphabets_give_complete_codes(present):
    freq = np.zeros(256, np.int64)
    freq[present] = 5
    lengths = codec.code_lengths(freq)
    assert codec.kraft_complete(lengths)
    assert all(lengths[s] == 1 for s in present)


def test_canonical_codes_are_prefix_free():
    freq = np.random.default_rng(0).integers(0, 10_000, 256) ** 3
    lengths = codec.code_lengths(freq)
    codes = codec.canonical_codes(lengths)
    words = {format(int(codes[s]), f"0{int(lengths[s])}b") for s in range(256) if lengths[s]}
    assert len(words) == (lengths > 0).sum()
    for a in words:
        assert not any(b != a and b.startswith(a) for b in words)


def test_kraft_check_refuses_broken_tables():
    lengths = codec.code_lengths(np.arange(256) + 1)
    assert codec.kraft_complete(lengths)
    for broken in (lambda l: l.__setitem__(0, l[0] + 1), lambda l: l.__setitem__(5, 0),
                   lambda l: l.__setitem__(9, CODE_BITS + 1)):
        bad = lengths.copy()
        broken(bad)
        assert not codec.kraft_complete(bad)


def test_device_checksum_matches_numpy_and_sees_any_one_change():
    x = (np.random.default_rng(0).standard_normal((300, 77)) * 0.02).astype(ml_dtypes.bfloat16)
    want = codec.checksum(x)
    assert int(device_checksum(jnp.asarray(x))) == want
    bits = x.view(np.uint16).copy()
    for i, delta in [(0, 1), (12345, 0x8000), (300 * 77 - 1, 0x7FFF)]:
        changed = bits.copy().reshape(-1)
        changed[i] ^= delta
        assert codec.checksum(changed) != want


def test_layout_lanes_and_steps():
    assert codec.make_layout((30, 576, 1536), (0, 2, 1), 1, 1).lanes == 2  # 576 columns: 2 lanes of 288
    lay = codec.make_layout((9, 36864))
    assert (lay.rows, lay.cols, lay.lanes, lay.steps) == (9, 36864, 128, 288)
    assert codec.make_layout((100,)).lanes == 1


def test_small_or_incompressible_tensors_stay_raw():
    assert codec.maybe_encode(np.zeros(1000, np.uint16), codec.make_layout((1000,))) is None  # too small
    noise = np.random.default_rng(0).integers(0, 1 << 16, 1 << 16, dtype=np.uint32).astype(np.uint16)
    assert codec.maybe_encode(noise, codec.make_layout(noise.shape)) is None  # 8 bits of exponent: no gain
    weights = (np.random.default_rng(0).standard_normal(1 << 16) * 0.02).astype(ml_dtypes.bfloat16)
    assert codec.maybe_encode(weights, codec.make_layout(weights.shape)).nbytes < 0.7 * weights.nbytes
