"""DeepSeek-V3 block-FP8 dequantization against a per-block loop and transformers' own
dequantizers (torch, CPU)."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

from jfire.checkpoint.fp8 import dequantize_fp8_block

FP8 = ml_dtypes.float8_e4m3fn


def make_case(seed, shape, block=128):
    rng = np.random.default_rng(seed)
    # Normals, subnormals and the largest finite value (+-448; e4m3fn has no inf and overflows to NaN).
    weight = np.clip(rng.standard_normal(shape) * 100, -448, 448).astype(FP8)
    grid = (*shape[:-2], -(-shape[-2] // block), -(-shape[-1] // block))
    scale_inv = (rng.uniform(0.5, 2.0, grid) * 2.0 ** rng.integers(-12, -4, grid)).astype(np.float32)
    return weight, scale_inv


def per_block_loop(weight, scale_inv, block):
    out, n_in = weight.shape
    want = np.zeros((out, n_in), np.float32)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            rows, cols = slice(bi * block, (bi + 1) * block), slice(bj * block, (bj + 1) * block)
            want[rows, cols] = weight[rows, cols].astype(np.float32) * scale_inv[bi, bj]
    return want


def as_torch_fp8(weight):
    return torch.from_numpy(np.ascontiguousarray(weight).view(np.uint8)).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("shape,block", [((300, 200), 128), ((256, 384), 128), ((7, 5), 2), ((128, 1), 128)])
def test_equals_per_block_loop(shape, block):
    weight, scale_inv = make_case(0, shape, block)
    got = dequantize_fp8_block(weight, scale_inv, block)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(got, per_block_loop(weight, scale_inv, block))


def test_stacked_experts_dequantize_one_by_one():
    weight, scale_inv = make_case(1, (3, 300, 200))
    got = dequantize_fp8_block(weight, scale_inv)
    for e in range(3):
        assert np.array_equal(got[e], per_block_loop(weight[e], scale_inv[e], 128))


def test_refuses_a_scale_grid_that_does_not_tile():
    weight, scale_inv = make_case(2, (300, 200))
    with pytest.raises(ValueError, match="does not tile"):
        dequantize_fp8_block(weight, scale_inv[:2, :1])


def test_equals_transformers_with_partial_edge_blocks():
    """transformers' FP8 backward-pass dequantizer, which handles partial edge blocks."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight, scale_inv = make_case(3, (300, 200))
    want = _dequantize_fp8_weight(as_torch_fp8(weight), torch.from_numpy(scale_inv), [128, 128], torch.float32)
    assert np.array_equal(dequantize_fp8_block(weight, scale_inv), want.numpy())


def test_equals_transformers_load_time_dequantize():
    """transformers' `dequantize=True` loading op (whole blocks only: it derives the block from
    the grid)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    weight, scale_inv = make_case(4, (256, 384))
    want = Fp8Dequantize(None)._dequantize_one(as_torch_fp8(weight), torch.from_numpy(scale_inv), torch.float32)
    assert np.array_equal(dequantize_fp8_block(weight, scale_inv), want.numpy())


def _rewrite(src, dst, transform):
    """A copy of HF directory src with every tensor passed through transform(name, array) -> {name: array}."""
    import shutil

    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    out = {}
    for name, value in load_file(src / "model.safetensors").items():
        out.update(transform(name, value.float().numpy()))
    save_file(out, dst / "model.safetensors")
    return dst


def _is_linear(name, value):
    return value.ndim == 2 and name.endswith("proj.weight")


def test_fp8_and_bf16_checkpoints_load_as_the_values_they_hold(tiny_hf_dir, tmp_path):
    """A tiny DeepSeek-V3 written as DeepSeek releases it (FP8 e4m3 linears with block-128
    `weight_scale_inv`) and as bf16 loads exactly as the same model written in float32 with
    the values those encodings stand for."""
    from jfire.checkpoint.load import load_model

    src = tiny_hf_dir("deepseek_v3")
    dequantized, changed = {}, []

    def to_fp8(name, w):
        if not _is_linear(name, w):
            dequantized[name] = w
            return {name: w}
        scale_inv = np.maximum(np.abs(w).max(), 1e-12).astype(np.float32).reshape(1, 1) / 448  # one block
        q = (w / scale_inv).astype(FP8)
        dequantized[name] = q.astype(np.float32) * scale_inv
        changed.append(not np.array_equal(dequantized[name], w))
        return {name: q, name + "_scale_inv": scale_inv}

    fp8 = _rewrite(src, tmp_path / "fp8", to_fp8)
    plain = _rewrite(src, tmp_path / "dequantized", lambda name, w: {name: dequantized[name]})
    bf16 = _rewrite(src, tmp_path / "bf16", lambda name, w: {name: w.astype(ml_dtypes.bfloat16)})
    rounded = _rewrite(src, tmp_path / "rounded", lambda name, w: {name: w.astype(ml_dtypes.bfloat16).astype(np.float32)})
    for encoded, reference in ((fp8, plain), (bf16, rounded)):
        got, want = load_model(str(encoded), "float32").params, load_model(str(reference), "float32").params
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert changed and all(changed)  # FP8 really rounded every linear: the load reads the scales
