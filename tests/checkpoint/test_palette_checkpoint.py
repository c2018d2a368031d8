"""Checkpoints coded with the palette codec (`jfire convert --compress palette|auto`) against the
plain checkpoint of the same weights: bit-identical params, the manifest's versions (a
Huffman-only checkpoint is written as before), palette layers kept coded and decoded in the
layer loop, damage refused by name, and the report's codec and path per tensor."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.checkpoint import compressed, store
from jfire.checkpoint.convert import convert
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.errors import JfireError
from jfire.kernels.layer_weights import FusedPalette, layer_slice
from jfire.kernels.palette_matmul import Palette
from jfire.models import family
from jfire.sampling import SamplingParams
from tests.checkpoint.test_compressed_checkpoint import copy_with, flip, same_bits


@pytest.fixture(scope="module")
def converted(compressible_hf_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("palette")
    return {codec: convert(compressible_hf_dir, root / codec, "bfloat16", progress=False, compress=codec or False)
            for codec in ("", "huffman", "palette", "auto")}


def manifest(path) -> dict:
    return json.loads((path / "jfire.json").read_text())


def test_versions_and_codecs_per_tensor(converted):
    huffman = manifest(converted["huffman"])["compression"]
    assert (huffman["codec"], huffman["codec_version"], huffman["code_bits"]) == ("bf16-exponent-huffman", 1, 12)
    assert "palette_version" not in huffman  # as written before the palette codec existed
    for codec in ("palette", "auto"):
        section = manifest(converted[codec])["compression"]
        assert (section["codec"], section["codec_version"], section["palette_version"]) == ("bf16-exponent", 2, 1)
    stored = {codec: {name: t["stored"] for name, t in manifest(converted[codec])["compression"]["tensors"].items()}
              for codec in ("palette", "auto")}
    assert stored["palette"]["embed"] == stored["palette"]["layers.w_down"] == "palette"
    assert stored["palette"]["final_norm"] == "raw"
    # auto: palette where the fused matmul serves the weight, Huffman for the embedding (a gather).
    assert stored["auto"]["layers.w_gate"] == stored["auto"]["lm_head"] == "palette"
    assert stored["auto"]["embed"] == "huffman"
    ratios = {codec: compressed.ratio(manifest(converted[codec])["compression"]) for codec in ("huffman", "palette")}
    assert ratios["huffman"] < ratios["palette"] < 0.76


@pytest.mark.parametrize("codec", ["palette", "auto"])
def test_loads_bit_identical_to_plain(converted, codec):
    want, got = load_model(str(converted[""]), "bfloat16"), load_model(str(converted[codec]), "bfloat16")
    assert jax.tree.structure(want.params) == jax.tree.structure(got.params)
    for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(got.params)):
        assert same_bits(a, b)


def test_kept_palette_layers_decode_in_the_layer_loop(converted):
    """--keep-compressed over a palette checkpoint: layer weights stay palette-coded on the
    device, at their stored size, and layer i decoded in the body of a scan over layer ids
    (as the models' layer loop does) equals the plain checkpoint's layer i."""
    _, params = compressed.restore(converted["palette"], store.read_manifest(converted["palette"]), jnp.float32,
                                   keep_compressed=True)
    layers = params["layers"]
    assert isinstance(layers["w_up"], Palette) and not isinstance(params["embed"], Palette)
    want = load_model(str(converted[""]), "float32").params
    bf16_bytes = sum(x.size * 2 for x in jax.tree.leaves(want["layers"]))
    assert compressed.compressed_bytes(layers) < 0.76 * bf16_bytes
    _, decoded = jax.jit(lambda: jax.lax.scan(lambda c, i: (c, layer_slice(layers, i, dtype=jnp.float32)), 0,
                                              jnp.arange(2)))()
    for name, value in want["layers"].items():
        assert same_bits(decoded[name], value), name


def test_fused_layers_equal_the_layers_decoded_first(converted):
    """Kept palette-coded linear layers multiplied coded (the fused matmul; interpret mode on the
    CPU) for products of up to 8 rows, decoded first beyond (a longer prompt's prefill): a
    forward pass's logits equal the decoded path's within float32 summation error, and the
    engine's greedy tokens are the plain checkpoint's."""
    kept = load_model(str(converted["palette"]), "float32", keep_compressed=True)
    fused = dataclasses.replace(kept, params=compressed.fuse_layers(kept.params, kept.config, jnp.float32, max_rows=8))
    assert isinstance(fused.params["layers"]["w_up"], FusedPalette) and isinstance(fused.params["embed"], jax.Array)
    assert compressed.compressed_bytes(fused.params) == compressed.compressed_bytes(kept.params)
    cfg = kept.config
    tokens = jnp.array([[3, 14, 15], [9, 2, 6]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
    forward = jax.jit(lambda params: family.forward(params, cfg, tokens, positions,
                                                    family.init_cache(cfg, 2, 16, jnp.float32))[0])
    want, got = np.asarray(forward(kept.params)), np.asarray(forward(fused.params))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert not np.array_equal(got, want)  # (the fused products did run: their sums are in another order)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [30, 31], [40, 41, 42]]

    def generate(model):
        config = EngineConfig(max_batch=4, max_prefill_rows=4, prefill_budget=16, max_model_len=64, num_pages=32,
                              aot=False)
        with Engine(model, config) as engine:
            return [c.token_ids for c in engine.generate([(p, greedy) for p in prompts])]

    assert generate(fused) == generate(load_model(str(converted[""]), "float32"))


@pytest.mark.parametrize("damage, match", [
    (lambda t: flip(t, "layers.w_up", "codes", 999), "tensor 'layers.w_up' fails its checksum"),
    (lambda t: flip(t, "layers.wq", "palette", 5), "tensor 'layers.wq' fails its checksum"),
    (lambda t: flip(t, "embed", "exc_start", 6), "tensor 'embed' has invalid exception lists"),
])
def test_damaged_arrays_are_refused_by_name(converted, tmp_path, damage, match):
    bad = copy_with(converted["palette"], tmp_path / "bad", edit_tree=damage)
    with pytest.raises(JfireError, match=match):
        load_model(str(bad), "bfloat16")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["compression"].update(palette_version=2), "'bf16-exponent' version 2 \\(palette version 1\\)"),
    (lambda m: m["compression"].update(codec="bf16-exponent-huffman", codec_version=1),
     "does not describe tensor 'embed'"),  # a palette tensor in a Huffman-only manifest
    (lambda m: m["compression"]["tensors"]["layers.wo"].update(exceptions=-1), "does not describe tensor 'layers.wo'"),
])
def test_bad_manifests_are_refused(converted, tmp_path, edit, match):
    bad = copy_with(converted["palette"], tmp_path / "bad", edit_manifest=edit)
    with pytest.raises(JfireError, match=match):
        load_model(str(bad), "bfloat16")


def test_report_shows_codec_ratio_and_path(converted, capsys):
    from jfire.cli import main

    # The load test's decoder, so its compiled decoders serve here too.
    assert main(["compress-report", str(converted["auto"]), "--json", "--decoder", "pallas-interpret"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {t["name"]: t for t in report["tensors"]}
    assert (rows["layers.w_down"]["stored"], rows["layers.w_down"]["path"], rows["layers.w_down"]["k"]) == (
        "palette", "fused", 3)
    assert (rows["embed"]["stored"], rows["embed"]["path"]) == ("huffman", "decode")
    assert (rows["final_norm"]["stored"], rows["final_norm"]["path"]) == ("raw", "plain")
    assert report["total"]["round_trip"] and rows["layers.w_down"]["ratio"] < 0.76
