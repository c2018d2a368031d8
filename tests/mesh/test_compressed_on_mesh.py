"""A compressed checkpoint on a pp=2 x tp=2 mesh: loaded, the same bits shard for shard as the
uncompressed checkpoint of the same weights placed on that mesh; kept compressed, every device
holds only its own block of each layer stack, coded, which decodes alone to that device's
shard, and the engine gives one device's greedy tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

from jfire import mesh as meshes
from jfire.checkpoint.convert import convert
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.kernels.layer_weights import CodedBlocks, decode
from jfire.models.params import get_path
from jfire.sampling import SamplingParams
from tests.tiny_models import COMMON

MESH = "pp=2,tp=2"
CODECS = ("huffman", "palette")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [30, 31], [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Llama (2 layers, 4 heads of 32, 2 KV heads) plain and coded both ways. Its palette
    tiles are 64 columns wide: tp=2 cuts the q, o and MLP stacks between tiles but the k and v
    stacks (2 x 32 columns) inside one."""
    tmp = tmp_path_factory.mktemp("compressed_mesh")
    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 512,
                                         "initializer_range": 0.02})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp / "hf")
    paths = {"plain": convert(tmp / "hf", tmp / "plain", "bfloat16", progress=False)}
    for codec in CODECS:
        paths[codec] = convert(tmp / "hf", tmp / codec, "bfloat16", progress=False, compress=codec)
    return paths


@pytest.fixture(scope="module")
def one_device_tokens(checkpoints):
    return generate(load_model(str(checkpoints["plain"]), "float32"))


def generate(model):
    config = EngineConfig(max_batch=4, max_prefill_rows=4, prefill_budget=16, max_model_len=128, num_pages=64,
                          aot=False)
    with Engine(model, config) as engine:
        return [c.token_ids for c in engine.generate([(p, GREEDY) for p in PROMPTS])]


def shard_on(a: jax.Array, device):
    return next(s.data for s in a.addressable_shards if s.device == device)


@pytest.mark.parametrize("codec", CODECS)
def test_compressed_checkpoint_on_pp2_tp2(checkpoints, codec):
    spec = meshes.resolve(MESH)
    want = load_model(str(checkpoints["plain"]), "float32", mesh_spec=spec)
    got = load_model(str(checkpoints[codec]), "float32", mesh_spec=spec)
    for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(got.params), strict=True):
        assert a.sharding == b.sharding
        for x, y in zip(a.addressable_shards, b.addressable_shards, strict=True):
            assert x.device == y.device and np.array_equal(np.asarray(x.data), np.asarray(y.data))


@pytest.mark.parametrize("codec", CODECS)
def test_kept_compressed_on_pp2_tp2_each_device_holds_and_decodes_its_block(checkpoints, one_device_tokens, codec):
    spec = meshes.resolve(MESH)
    plain = load_model(str(checkpoints["plain"]), "float32", mesh_spec=spec)
    kept = load_model(str(checkpoints[codec]), "float32", mesh_spec=spec, keep_compressed=True)
    coded = {}
    for param in kept.config.param_specs():
        leaf = get_path(kept.params, param.name)
        if isinstance(leaf, CodedBlocks):
            coded[param.name] = (leaf, get_path(plain.params, param.name))
    # The k and v stacks of the palette checkpoint cannot be cut between tiles: decoded on
    # load and placed, as plain weights.
    stacks = {"layers.wq", "layers.wk", "layers.wv", "layers.wo", "layers.w_gate", "layers.w_up", "layers.w_down"}
    assert set(coded) == (stacks - {"layers.wk", "layers.wv"} if codec == "palette" else stacks)
    devices = list(kept.mesh.devices.flat)
    held = dict.fromkeys(devices, 0)
    for name, (leaf, weight) in coded.items():
        assert leaf.block_axes == ("pp", "tp")
        for device in devices:
            mine = jax.tree.map(lambda a, d=device: shard_on(a, d), leaf.coded)
            assert all(a.shape[0] == 1 for a in jax.tree.leaves(mine))  # one block, its own
            held[device] += mine.nbytes
            alone = decode(jax.tree.map(lambda a: a[0], mine), "reference")
            assert np.array_equal(np.asarray(alone.astype(np.float32)), np.asarray(shard_on(weight, device))), name
    whole = sum(leaf.nbytes for leaf, _ in coded.values())
    assert all(n < whole / 3 for n in held.values()), (held, whole)
    assert generate(kept) == one_device_tokens
