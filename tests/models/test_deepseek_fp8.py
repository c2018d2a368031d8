"""DeepSeek-V3 as released: every linear float8 e4m3 with 128 x 128 block scales
(`weight_scale_inv`) and `quantization_config.quant_method = "fp8"`. The routed experts stay FP8
on the device; the reference is transformers running the same model on the dequantized weights.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file

from jfire.checkpoint.fp8 import dequantize_fp8_block
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.errors import JfireError
from jfire.models import fp8_experts
from jfire.sampling import SamplingParams
from tests.tiny_models import (assert_conversion_keeps_params, grouped_matmul_reference, quantized_release,
                                tiny_hf_config)

FP8 = ml_dtypes.float8_e4m3fn
BLOCK = 128
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
GREEDY_STEPS = 16


def quantize_fp8_block(w):
    """(FP8 codes, float32 scale_inv per 128 x 128 block) as DeepSeek's checkpoints hold them:
    each block's largest magnitude maps to e4m3's largest finite value, 448."""
    out, n_in = w.shape
    blocks = (-(-out // BLOCK), -(-n_in // BLOCK))
    padded = np.zeros((blocks[0] * BLOCK, blocks[1] * BLOCK), np.float32)
    padded[:out, :n_in] = w
    peak = np.abs(padded.reshape(blocks[0], BLOCK, blocks[1], BLOCK)).max(axis=(1, 3))
    scale_inv = (np.maximum(peak, 1e-12) / 448).astype(np.float32)
    codes = (w / np.repeat(np.repeat(scale_inv, BLOCK, 0), BLOCK, 1)[:out, :n_in]).astype(FP8)
    return codes, scale_inv


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(the released-layout directory, the HF model on the dequantized weights)."""
    def to_fp8(name, value):
        if not (value.ndim == 2 and name.endswith("proj.weight")):
            return None
        codes, scale_inv = quantize_fp8_block(value)
        return {name: codes, name + "_scale_inv": scale_inv}, dequantize_fp8_block(codes, scale_inv)

    tensors, model = quantized_release("deepseek_v3", 5, tmp_path_factory.mktemp("v3"), to_fp8)
    path = tmp_path_factory.mktemp("deepseek_v3_fp8")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path / "model.safetensors")
    config = {**tiny_hf_config("deepseek_v3").to_dict(), "quantization_config": QUANTIZATION}
    (path / "config.json").write_text(json.dumps(config))
    return path, model


def test_routed_experts_stay_fp8_on_the_device(released):
    model = load_model(str(released[0]), "float32")
    cfg = model.config
    assert cfg.fp8_experts
    experts = model.params["layers"]["we_gate"]
    moe_layers, X, E, F = cfg.num_layers - cfg.dense_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert experts["fp8"].dtype == FP8
    # A byte a weight, plus one float32 scale per (partial) 128 x 128 block: never the float weights.
    assert sum(s.data.nbytes for s in experts["fp8"].addressable_shards) == moe_layers * X * F * E
    assert experts["scale_inv"].shape == (moe_layers, X, -(-F // BLOCK), -(-E // BLOCK))
    # The other linears are dequantized on load, into the model dtype.
    assert model.params["layers"]["wkv_b"].dtype == np.float32
    assert model.params["dense_layers"]["w_up"].dtype == np.float32


def greedy(model, prompt):
    with Engine(model, EngineConfig(max_batch=1, max_prefill_rows=1, aot=False, quick_compile=True)) as engine:
        return engine.generate([(prompt, SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS))])[0].token_ids


PROMPT = [int(x) for x in np.random.RandomState(6).randint(3, 256, size=13)]


def test_greedy_tokens_match_transformers_on_the_dequantized_weights(released):
    path, reference = released
    with torch.no_grad():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=GREEDY_STEPS, do_sample=False)[0, 13:]
    got = greedy(load_model(str(path), "float32"), PROMPT)
    assert got == expected.tolist() and len(got) == GREEDY_STEPS


def test_bf16_weights_equal_the_model_dequantized_on_load(released, tmp_path):
    """In bf16 the FP8 experts, dequantized in each step on the device, are bit for bit the
    weights of the same checkpoint with every weight dequantized by the loader (both round the
    float32 product to bf16 once); every other param is the same array."""
    path, _ = released
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (dequantized / "config.json").write_text(json.dumps(config))
    (dequantized / "model.safetensors").symlink_to(path / "model.safetensors")
    kept, on_load = load_model(str(path), "bfloat16"), load_model(str(dequantized), "bfloat16")
    assert kept.config.fp8_experts and not on_load.config.fp8_experts
    for proj in ("we_gate", "we_up", "we_down"):
        fp8 = kept.params["layers"].pop(proj)
        device = fp8_experts.dequantize(fp8["fp8"], fp8["scale_inv"], jnp.bfloat16)  # [layers, X, in, out]
        loaded = on_load.params["layers"].pop(proj)
        assert device.dtype == loaded.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(device).view(np.uint16), np.asarray(loaded).view(np.uint16))
    for a, b in zip(jax.tree.leaves(kept.params), jax.tree.leaves(on_load.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_device_dequantize_equals_the_host_loader():
    """fp8_experts.dequantize (the matmul's) against checkpoint.fp8 (the loader's), on stacked
    experts with several blocks and partial edge blocks, in the engine's [in, out] layout."""
    rng = np.random.default_rng(7)
    codes = np.clip(rng.standard_normal((3, 300, 200)) * 100, -448, 448).astype(FP8)
    scale_inv = (rng.uniform(0.5, 2.0, (3, 3, 2)) * 2.0 ** rng.integers(-12, -4, (3, 3, 2))).astype(np.float32)
    got = np.asarray(fp8_experts.dequantize(jnp.asarray(codes), jnp.asarray(scale_inv), jnp.float32))
    np.testing.assert_array_equal(got, np.swapaxes(dequantize_fp8_block(codes, scale_inv), -1, -2))


def test_grouped_matmul_equals_dequantize_then_matmul(released):
    model = load_model(str(released[0]), "float32")
    w = jax.tree.map(lambda a: a[0], model.params["layers"]["we_down"])
    X = w["fp8"].shape[0]
    sizes = np.array([3, 0, 5, 1, 0, 2, 4, 1][:X], np.int32)
    xs = np.random.RandomState(8).randn(int(sizes.sum()) + 2, w["fp8"].shape[2]).astype(np.float32)
    got = np.asarray(fp8_experts.ragged_dot_fp8(xs, w["fp8"], w["scale_inv"], sizes))
    dense = np.swapaxes(dequantize_fp8_block(np.asarray(w["fp8"]), np.asarray(w["scale_inv"])), -1, -2)
    np.testing.assert_allclose(got, grouped_matmul_reference(xs, dense, sizes), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "compressed"])
def test_converted_checkpoint_keeps_the_experts_fp8(released, tmp_path, compress):
    """`jfire convert` writes the FP8 experts and their scales as they are (compressed
    checkpoints store them raw beside the bf16 codec's tensors); loading gives the source's params."""
    converted = assert_conversion_keeps_params(released[0], tmp_path / "ckpt", compress)
    assert converted.params["layers"]["we_up"]["fp8"].dtype == FP8


def test_experts_that_are_not_fp8_are_refused(released, tmp_path):
    """A config saying FP8 over experts stored in another dtype: casting would round them."""
    path, _ = released
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.2.mlp.experts.0.up_proj.weight"
    tensors[name] = tensors[name].float()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    from safetensors.torch import save_file as save_torch

    save_torch(tensors, bad / "model.safetensors")
    with pytest.raises(JfireError, match="float8_e4m3fn"):
        load_model(str(bad), "float32")


def test_other_fp8_blocks_are_refused(released, tmp_path):
    config = json.loads((released[0] / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (tmp_path / "config.json").write_text(json.dumps(config))
    from jfire.models.registry import config_from_hf

    with pytest.raises(JfireError, match="128 x 128"):
        config_from_hf(config)
