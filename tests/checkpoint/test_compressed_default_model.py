"""The default model compressed: bit-identical weights to its uncompressed bf16 checkpoint,
loaded in bf16 and in float32, and the same greedy tokens."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.checkpoint import compressed, store
from jfire.checkpoint.convert import convert
from jfire.checkpoint.default_model import default_gguf_path
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.sampling import SamplingParams


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory):
    """The default GGUF converted to a plain bf16 checkpoint, and the same weights compressed
    (compressed.save is what `jfire convert --compress` calls after reading the source)."""
    root = tmp_path_factory.mktemp("default")
    plain = convert(default_gguf_path(), root / "plain", "bfloat16", progress=False)
    config, params = store.restore(plain, jnp.bfloat16)
    section = compressed.save(root / "packed", config, params)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(plain / name, root / "packed" / name)
    return plain, root / "packed", section


def generate(model, ids):
    with Engine(model, EngineConfig(max_batch=1, max_prefill_rows=1, aot=False)) as engine:
        return engine.generate([(ids, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))])[0].token_ids


def test_compressed_default_model_matches_uncompressed(default_pair):
    plain, packed, section = default_pair
    assert compressed.ratio(section) <= 0.69  # measured 0.671, every table and offset counted
    assert all(t["stored"] == "huffman" for name, t in section["tensors"].items() if name != "final_norm")
    for dtype in ("bfloat16", "float32"):
        want, got = load_model(str(plain), dtype), load_model(str(packed), dtype)
        for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(got.params), strict=True):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    # Greedy tokens in float32 (the bf16 weights upcast). The bf16 params above are the same
    # bits, so bf16 programs would compute the same; on this CPU they take ~10 s a token.
    ids = want.tokenizer.encode("The three most important inventions in history are")
    assert generate(got, ids) == generate(want, ids)
