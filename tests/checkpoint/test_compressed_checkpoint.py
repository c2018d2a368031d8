"""Compressed checkpoints against uncompressed ones of the same weights: bit-identical params
in bf16 and float32, layers decoded one at a time in a scan, and every kind of damage
(payload, tables, raw tensors, truncation, byte flips, manifest) refused by name."""

from __future__ import annotations

import gc
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jfire.checkpoint import compressed, store
from jfire.checkpoint.convert import convert
from jfire.checkpoint.load import load_model
from jfire.errors import JfireError
from jfire.kernels.bf16_decode import Compressed
from jfire.kernels.layer_weights import layer_slice
from jfire.models.params import get_path

# A truncated file leaves orbax's own read coroutines to be collected later; their warnings
# are orbax's, not a failure of these tests.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def checkpoints(compressible_hf_dir, tmp_path_factory):
    """The same small random Llama converted plain and compressed."""
    root = tmp_path_factory.mktemp("compressed")
    plain = convert(compressible_hf_dir, root / "plain", "bfloat16", progress=False)
    packed = convert(compressible_hf_dir, root / "packed", "bfloat16", progress=False, compress=True)
    return plain, packed


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compressed_loads_bit_identical_to_plain(checkpoints, dtype):
    plain, packed = checkpoints
    manifest = json.loads((packed / "jfire.json").read_text())
    assert manifest["format"] == 2 and json.loads((plain / "jfire.json").read_text())["format"] == 1
    assert compressed.ratio(manifest["compression"]) < 0.70
    stored = {name: t["stored"] for name, t in manifest["compression"]["tensors"].items()}
    assert stored["layers.w_gate"] == stored["embed"] == "huffman" and stored["final_norm"] == "raw"
    want, got = load_model(str(plain), dtype), load_model(str(packed), dtype)
    assert jax.tree.structure(want.params) == jax.tree.structure(got.params)
    for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(got.params)):
        assert same_bits(a, b)


def test_keep_compressed_layers_decode_in_the_layer_loop(checkpoints):
    plain, packed = checkpoints
    want = load_model(str(plain), "float32").params
    _, params = compressed.restore(packed, store.read_manifest(packed), jnp.float32, keep_compressed=True)
    layers = params["layers"]
    assert isinstance(layers["w_gate"], Compressed) and not isinstance(layers["attn_norm"], Compressed)
    assert same_bits(params["embed"], want["embed"])  # only layer weights stay compressed
    bf16_bytes = sum(x.size * 2 for x in jax.tree.leaves(want["layers"]))
    assert compressed.compressed_bytes(layers) < 0.72 * bf16_bytes

    def body(carry, i):
        return carry, layer_slice(layers, i, dtype=jnp.float32)

    _, decoded = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(2)))()
    for name, value in want["layers"].items():
        assert same_bits(decoded[name], value), name


def copy_with(packed, dst, edit_tree=None, edit_manifest=None):
    """A copy of the checkpoint with its stored arrays and/or manifest edited."""
    shutil.copytree(packed, dst)
    if edit_tree:
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.restore(packed / "params")
        edit_tree(tree)
        shutil.rmtree(dst / "params")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(dst / "params", tree)
    if edit_manifest:
        manifest = json.loads((dst / "jfire.json").read_text())
        edit_manifest(manifest)
        (dst / "jfire.json").write_text(json.dumps(manifest))
    return dst


def flip(tree, name, key, index):
    array = np.array(get_path(tree, name)[key] if key else get_path(tree, name))
    array.view(np.uint8).reshape(-1)[index] ^= 0x10
    if key:
        get_path(tree, name)[key] = array
    else:
        parent, leaf = name.rsplit(".", 1) if "." in name else (None, name)
        (get_path(tree, parent) if parent else tree)[leaf] = array


@pytest.mark.parametrize("damage, match", [
    (lambda t: flip(t, "layers.w_up", "payload", 999), "tensor 'layers.w_up' fails its checksum"),
    (lambda t: flip(t, "embed", "raw", 12345), "tensor 'embed' fails its checksum"),
    (lambda t: flip(t, "layers.attn_norm", None, 3), "tensor 'layers.attn_norm' fails its checksum"),
    (lambda t: flip(t, "layers.wq", "code_lengths", 300), "tensor 'layers.wq' has invalid code tables"),
    (lambda t: flip(t, "layers.wk", "lane_bits", 1), "tensor 'layers.wk' has invalid code tables or lane lengths"),
])
def test_damaged_arrays_are_refused_by_name(checkpoints, tmp_path, damage, match):
    _, packed = checkpoints
    bad = copy_with(packed, tmp_path / "bad", edit_tree=damage)
    with pytest.raises(JfireError, match=match):
        load_model(str(bad), "bfloat16")


def data_files(path):
    return sorted((f for f in (path / "params").rglob("*") if f.is_file() and f.parent.name == "d"),
                  key=lambda f: f.stat().st_size)


def test_truncated_or_flipped_files_are_refused(checkpoints, tmp_path):
    _, packed = checkpoints
    truncated = copy_with(packed, tmp_path / "truncated")
    biggest = data_files(truncated)[-1]
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    with pytest.raises(JfireError, match=r"tensor '[\w.]+' cannot be read .* truncated or corrupt"):
        load_model(str(truncated), "bfloat16")
    gc.collect()  # orbax's abandoned reads, collected here rather than in some later test

    flipped = copy_with(packed, tmp_path / "flipped")
    biggest = data_files(flipped)[-1]
    data = bytearray(biggest.read_bytes())
    for i in range(len(data) // 3, len(data), len(data) // 7):
        data[i] ^= 0x01
    biggest.write_bytes(bytes(data))
    with pytest.raises(JfireError, match=r"tensor '[\w.]+' (fails its checksum|cannot be read)"):
        load_model(str(flipped), "bfloat16")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(format=3), "format 3; this jfire reads formats 1 and 2"),
    (lambda m: m["compression"].update(codec_version=99), "codec 'bf16-exponent-huffman' version 99"),
    (lambda m: m["compression"]["tensors"].pop("layers.wo"), "does not describe tensor 'layers.wo'"),
    (lambda m: m["compression"]["tensors"]["embed"]["layout"].update(shape=[512, 64]),
     r"tensor 'embed' is stored with shape \(512, 64\)"),
    (lambda m: m["compression"]["tensors"]["lm_head"].update(checksum=12345), "tensor 'lm_head' fails its checksum"),
])
def test_bad_manifests_are_refused(checkpoints, tmp_path, edit, match):
    _, packed = checkpoints
    bad = copy_with(packed, tmp_path / "bad", edit_manifest=edit)
    with pytest.raises(JfireError, match=match):
        load_model(str(bad), "bfloat16")


def test_engine_with_layers_kept_compressed_generates_the_same_tokens(checkpoints):
    """The serving engine over a params tree whose layer weights stay compressed on the device
    (decoded inside the layer loop) gives the tokens of the plain checkpoint."""
    from jfire.engine import Engine, EngineConfig
    from jfire.sampling import SamplingParams

    plain, packed = checkpoints
    config = EngineConfig(max_batch=2, max_prefill_rows=2, prefill_budget=16, max_model_len=64, num_pages=32, aot=False,
                          quick_compile=True)  # a tiny model, a few tokens
    requests = [([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
                ([11, 12], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))]
    with Engine(load_model(str(plain), "float32"), config) as engine:
        want = [c.token_ids for c in engine.generate(requests)]
    kept = load_model(str(packed), "float32", keep_compressed=True)
    assert isinstance(kept.params["layers"]["w_up"], Compressed)
    with Engine(kept, config) as engine:
        assert [c.token_ids for c in engine.generate(requests)] == want
    with pytest.raises(JfireError, match="--compress"):
        load_model(str(plain), "float32", keep_compressed=True)
