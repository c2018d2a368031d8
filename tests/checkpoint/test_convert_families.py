"""Conversion of the MoE families into jfire checkpoints (plain and compressed) gives back the
weights read straight from the HF directory, bit for bit; the multimodal Llama 4 layout's
vision tower is skipped with one line saying so; per-layer params are stored a layer per chunk;
a checkpoint of alternating layers stored before periodic stacks is refused by name."""

from __future__ import annotations

import json

import jax
import numpy as np
import tensorstore as ts
import pytest

from jfire.checkpoint import store
from jfire.checkpoint.convert import convert
from jfire.checkpoint.load import load_model
from jfire.errors import JfireError


@pytest.mark.parametrize("family,compress", [("llama4_mm", True), ("qwen3_moe_sparse", False)])
def test_converted_checkpoint_equals_the_hf_weights(family, compress, tiny_hf_dir, tmp_path, capsys):
    src = tiny_hf_dir(family)
    dst = convert(src, tmp_path / "ck", "bfloat16", progress=False, compress=compress)
    skipped = [line for line in capsys.readouterr().err.splitlines() if "skipping" in line]
    if family == "llama4_mm":
        assert len(skipped) == 1 and "vision_model" in skipped[0] and "multi_modal_projector" in skipped[0]
    else:
        assert not skipped
    assert store.read_manifest(dst)["family"] == ("llama4" if family.startswith("llama4") else "llama")
    want = load_model(str(src), "bfloat16").params
    got = load_model(str(dst), "bfloat16").params
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    assert_layer_chunks(dst, store.read_config(dst))
    # Both models alternate dense and MoE layers: one periodic segment, stacked per position.
    # A checkpoint of theirs from before periodic stacks (one segment per run) is refused by name.
    assert "layers.moe1.we_gate" in {s.name for s in store.read_config(dst).param_specs()}
    manifest = json.loads((dst / store.MANIFEST).read_text())
    del manifest["layer_stacks"]
    (dst / store.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(JfireError, match="converted by an earlier jfire.*convert the model again"):
        load_model(str(dst), "bfloat16")


def assert_layer_chunks(dst, config):
    """Every stored array of a per-layer param that keeps the layers axis is chunked one layer
    at a time (what lets a process restoring some layers read only theirs)."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{dst / 'params'}/"}).result()
    arrays = {}
    for key in (k.decode() for k in kv.list().result()):
        if key.endswith("/.zarray"):
            meta = json.loads(kv.read(key).result().value)
            arrays[key[: -len("/.zarray")]] = (meta["shape"], meta["chunks"])
    for spec in config.param_specs():
        stored = {name: v for name, v in arrays.items() if name == spec.name or name.startswith(spec.name + ".")}
        assert stored, spec.name
        if spec.per_layer:
            layered = [chunks for shape, chunks in stored.values() if shape[0] == spec.shape[0]]
            assert layered and all(chunks[0] == 1 for chunks in layered), (spec.name, stored)
