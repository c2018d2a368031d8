"""Kimi K2.5's int4 pack-quantized experts as the compressed-tensors library itself writes them,
not as jfire's own helpers do: its `PackedQuantizationCompressor` (the compressor behind the
`pack-quantized` format) quantizes and packs each expert weight onto scales from its own
`calculate_qparams`, stored in bfloat16 as the release stores them; the scheme is the library's
reading of the checkpoint's `quantization_config`. The references are the library's own
decompressor (given the scales in float32, so that it returns the exact code x scale rather than
rounding it to the scales' bfloat16) and transformers on the weights it gives back.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.utils import calculate_qparams

from jfire.kernels.int4_experts import dequantize, pack_int4, unpack_int4_np
from tests.models.test_kimi_k25 import GREEDY_STEPS, GROUP, QUANTIZATION, greedy_tokens, write_release

SCHEME = QuantizationConfig.model_validate(QUANTIZATION).config_groups["group_0"]


def library_pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' `weight_packed`, `weight_scale` (bfloat16) and `weight_shape` for a
    weight [out, in], its scales computed in the weight's dtype as a quantizing run does."""
    groups = weight.unflatten(-1, (-1, SCHEME.weights.group_size))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights)
    return PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale.to(torch.bfloat16)}, SCHEME)


def library_unpack(state: dict[str, torch.Tensor]) -> np.ndarray:
    """The float32 weight [out, in] compressed-tensors reads back from its packed state."""
    state = {**state, "weight_scale": state["weight_scale"].float()}
    weight = PackedQuantizationCompressor.decompress(state, SCHEME)["weight"]
    assert weight.dtype == torch.float32
    return weight.numpy()


def scale_np(scale: torch.Tensor) -> np.ndarray:
    return scale.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def noise(seed, shape=(48, 96), dtype=torch.float32):
    """Weights of a few magnitudes, one group's worth per output row, each scaled its own way."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(1e-3, 1.0, (shape[0], 1)).astype(np.float32)
    return torch.from_numpy(w).to(dtype)


@pytest.mark.parametrize("seed", range(4))
def test_the_library_packs_float32_weights_as_jfire_does(seed):
    """On float32 weights (the tiny model's), jfire's `pack_int4` writes the library's words and
    scales bit for bit: the two sides of the other tests agree."""
    weight = noise(seed)
    state = library_pack(weight)
    packed, scale = pack_int4(weight.numpy(), GROUP)
    assert state["weight_packed"].dtype == torch.int32
    np.testing.assert_array_equal(state["weight_packed"].numpy(), packed)
    np.testing.assert_array_equal(scale_np(state["weight_scale"]), scale)
    np.testing.assert_array_equal(state["weight_shape"].numpy(), weight.shape)


@pytest.mark.parametrize("seed", range(4))
def test_the_library_packs_bfloat16_weights_as_jfire_does(seed):
    """On bfloat16 weights (a release's), where the library takes the quotient in bfloat16,
    jfire's `pack_int4` writes the same words and scales bit for bit too."""
    weight = noise(seed, dtype=torch.bfloat16)
    state = library_pack(weight)
    packed, scale = pack_int4(weight.float().numpy().astype(ml_dtypes.bfloat16), GROUP)
    np.testing.assert_array_equal(state["weight_packed"].numpy(), packed)
    np.testing.assert_array_equal(scale_np(state["weight_scale"]), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jfire_reads_the_library_s_packing(dtype):
    """Whatever codes the library chose (from float32 or from bfloat16 weights, where it divides
    in bfloat16), jfire's device unpacker and its numpy one read back exactly the library's
    values from the library's words and scales."""
    for seed in range(4):
        state = library_pack(noise(seed, dtype=dtype))
        want = library_unpack(state)
        packed, scale = state["weight_packed"].numpy(), scale_np(state["weight_scale"])
        np.testing.assert_array_equal(np.asarray(dequantize(packed, scale, np.float32)), want.T)
        np.testing.assert_array_equal(unpack_int4_np(packed, scale), want)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(the released-layout directory with the library's packed experts, the HF model on the
    weights the library reads back from them)."""

    def pack(value):
        state = library_pack(torch.from_numpy(value))
        stored = {
            "weight_packed": state["weight_packed"].numpy(),
            "weight_scale": scale_np(state["weight_scale"]),
            "weight_shape": state["weight_shape"].numpy(),
        }
        return stored, library_unpack(state)

    return write_release(tmp_path_factory, pack)


def test_experts_packed_by_the_library_give_transformers_tokens(released):
    got, expected = greedy_tokens(*released, "reference")
    assert got.token_ids == expected.tolist()
    assert len(got.token_ids) == GREEDY_STEPS
