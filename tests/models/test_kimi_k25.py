"""Kimi K2.5 in its released layout: `kimi_k25` config nesting the DeepSeek-V3 text model,
tensors under `language_model.`, a vision tower and projector beside it, and the routed
experts int4 pack-quantized (compressed-tensors). The test packs the experts itself; the
reference is transformers running the same text model with the dequantized expert weights.
test_kimi_k25_compressed_tensors.py packs them with the compressed-tensors library instead.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.kernels.int4_experts import pack_int4, unpack_int4_np
from jfire.sampling import SamplingParams
from tests.tiny_models import (assert_conversion_keeps_params, grouped_matmul_reference, quantized_release,
                                tiny_hf_config)

GREEDY_STEPS = 16
GROUP = 32
QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
}


def write_release(tmp_path_factory, pack_expert):
    """(the released-layout directory, the HF model with dequantized experts), the routed
    experts packed by pack_expert(float32 weight [out, in]) -> (the tensors stored under the
    weight's stem, `weight_packed`, `weight_scale` and `weight_shape`; the float32 values they
    mean)."""
    def pack(name, value):
        if ".mlp.experts." not in name:
            return None
        stored, meant = pack_expert(value)
        stem = name[: -len("weight")]
        return {stem + key: array for key, array in stored.items()}, meant

    tensors, model = quantized_release("kimi_k2", 3, tmp_path_factory.mktemp("k2"), pack)
    out = {"language_model." + name: value for name, value in tensors.items()}
    out["vision_tower.patch_embed.weight"] = np.zeros((4, 4), np.float32)
    out["mm_projector.proj.weight"] = np.zeros((4, 4), np.float32)
    path = tmp_path_factory.mktemp("kimi_k25")
    save_file({k: np.ascontiguousarray(v) for k, v in out.items()}, path / "model.safetensors")
    text = {**tiny_hf_config("kimi_k2").to_dict(), "model_type": "kimi_k2"}
    (path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text, "quantization_config": QUANTIZATION}))
    return path, model


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(the released-layout directory, the HF model with dequantized experts)."""
    def pack(value):
        packed, scale = pack_int4(value, GROUP)
        return ({"weight_packed": packed, "weight_scale": np.asarray(scale),
                 "weight_shape": np.asarray(value.shape, np.int32)}, unpack_int4_np(packed, scale))

    return write_release(tmp_path_factory, pack)


def greedy_tokens(path, reference, attention, length=11):
    """(jfire's greedy tokens from the directory, the reference HF model's) on a fixed prompt."""
    model = load_model(str(path), "float32")
    prompt = [int(x) for x in np.random.RandomState(4).randint(3, model.config.vocab_size, size=length)]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_STEPS, do_sample=False)[0, length:]
    with Engine(model, EngineConfig(max_batch=1, max_prefill_rows=1, aot=False, attention=attention,
                                     quick_compile=True)) as engine:
        got = engine.generate([(prompt, SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS))])[0]
    return got, expected


def test_int4_experts_stay_packed_on_the_device(released, capfd):
    path, _ = released
    model = load_model(str(path), "float32")
    assert "skipping 2 tensors under vision_tower, mm_projector" in capfd.readouterr().err
    cfg = model.config
    experts = model.params["layers"]["we_gate"]
    moe_layers, X, E, F = cfg.num_layers - cfg.dense_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert experts["packed"].dtype == np.int32
    # Half a byte per weight, plus one float32 scale per 32 of them: never the float weights.
    assert experts["packed"].nbytes == moe_layers * X * F * E // 2
    assert experts["scale"].nbytes == moe_layers * X * F * (E // GROUP) * 4
    on_device = sum(s.data.nbytes for s in experts["packed"].addressable_shards)
    assert on_device == moe_layers * X * F * E // 2


@pytest.mark.parametrize("attention,length", [("reference", 11), ("pallas-interpret", 11), ("pallas-interpret", 48)])
def test_greedy_tokens_match_transformers_on_the_dequantized_experts(released, attention, length):
    """Prefill and decode through the jnp latent attention and through the Pallas MLA kernels
    (interpret mode); the 48-token prompt's chunk is past the tiny model's threshold for the
    expanded form of MLA prefill (latent 32, heads of 16 + 16: 32 tokens), which it then runs."""
    if length == 48:
        from jfire.models.mla import prefill_expanded
        from jfire.programs import decode_attention

        cfg = load_model(str(released[0]), "float32").config
        assert prefill_expanded(cfg, decode_attention(attention), 48, 4096)
        assert not prefill_expanded(cfg, decode_attention(attention), 11, 4096)
    got, expected = greedy_tokens(*released, attention, length)
    assert got.token_ids == expected.tolist()
    assert len(got.token_ids) == GREEDY_STEPS


def test_packed_experts_equal_their_dequantized_reference(released):
    """The model's own int4 grouped matmul (the layer's packed experts) against dequantize-then-matmul."""
    from jfire.kernels.int4_experts import dequantize, ragged_dot_int4

    model = load_model(str(released[0]), "float32")
    w = jax.tree.map(lambda a: a[0], model.params["layers"]["we_down"])
    X = w["packed"].shape[0]
    sizes = np.array([3, 0, 5, 1, 0, 2, 4, 1][:X], np.int32)
    xs = np.random.RandomState(5).randn(int(sizes.sum()) + 2, w["packed"].shape[2] * 8).astype(np.float32)
    got = np.asarray(ragged_dot_int4(xs, w["packed"], w["scale"], sizes))
    dense = np.asarray(dequantize(w["packed"], w["scale"], np.float32))
    np.testing.assert_allclose(got, grouped_matmul_reference(xs, dense, sizes), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "compressed"])
def test_converted_checkpoint_keeps_the_experts_packed(released, tmp_path, compress):
    """`jfire convert` writes the int4 experts as packed words (compressed checkpoints store
    them raw beside the bf16 codec's tensors); loading gives the source's exact params."""
    converted = assert_conversion_keeps_params(released[0], tmp_path / "ckpt", compress)
    assert converted.params["layers"]["we_up"]["packed"].dtype == np.int32
