"""A compressed checkpoint loaded onto a mesh: the same bits, shard for shard, as the
uncompressed checkpoint of the same weights placed on that mesh."""

from __future__ import annotations

import jax
import numpy as np
import torch
import transformers

from jfire import mesh as meshes
from jfire.checkpoint.convert import convert
from jfire.checkpoint.load import load_model
from tests.tiny_models import COMMON


def test_compressed_checkpoint_on_pp2_tp2(tmp_path):
    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 512,
                                         "initializer_range": 0.02})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    plain = convert(tmp_path / "hf", tmp_path / "plain", "bfloat16", progress=False)
    packed = convert(tmp_path / "hf", tmp_path / "packed", "bfloat16", progress=False, compress=True)
    spec = meshes.resolve("pp=2,tp=2")
    want, got = load_model(str(plain), "float32", mesh_spec=spec), load_model(str(packed), "float32", mesh_spec=spec)
    for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(got.params), strict=True):
        assert a.sharding == b.sharding
        for x, y in zip(a.addressable_shards, b.addressable_shards, strict=True):
            assert x.device == y.device and np.array_equal(np.asarray(x.data), np.asarray(y.data))
