"""Pipeline x tensor parallel meshes on 8 CPU devices against one device: logits, greedy
tokens, memory per device, the collectives in the compiled program, the pipeline schedule."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire import mesh as meshes
from jfire import programs, sharding
from jfire.errors import JfireError
from jfire.kv_cache import init_pages
from jfire.models.llama import LlamaConfig
from jfire.models.params import init_params
from jfire.pipeline import Pipeline, schedule
from tests import greedy_programs

MESHES = ["pp=1,tp=8", "pp=2,tp=4", "pp=4,tp=2", "pp=8,tp=1"]
CFG = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                  num_layers=8, num_heads=16, num_kv_heads=8, head_dim=8, max_position_embeddings=256,
                  rope_theta=10000.0, qkv_bias=True)
PAGE, PAGES = 4, 64
ROWS, PROMPT, STEPS = 4, 12, 6


@pytest.fixture(scope="module")
def host_params():
    params = init_params(CFG.param_specs(), jax.random.key(0), jnp.float32, scale=0.1)
    return jax.tree.map(np.asarray, params)


def setup(host, spec_text):
    """(cfg, params, pages, layer_stack, mesh) for a mesh, or for one device when spec_text is None."""
    if spec_text is None:
        return CFG, jax.device_put(host), init_pages(CFG, PAGES, PAGE, jnp.float32), None, None
    spec = meshes.MeshSpec.inline(spec_text)
    meshes.check_fits(spec, CFG, jax.device_count())
    mesh = meshes.build(spec)
    cfg, params, _ = sharding.adapt_to_mesh(CFG, sharding.place(host, CFG, mesh), mesh)
    pages = init_pages(cfg, PAGES, PAGE, jnp.float32, sharding.cache_shardings(cfg, mesh))
    stack = Pipeline(mesh, spec.num_microbatches) if spec.pp > 1 else None
    return cfg, params, pages, stack, mesh


def run_greedy(host, spec_text):
    """Prefill ragged prompts, then decode; returns (per-step logits, tokens)."""
    cfg, params, pages, stack, _ = setup(host, spec_text)
    rng = np.random.default_rng(0)
    lengths = [12, 5, 9, 1]
    tokens = np.zeros((ROWS, 16), np.int32)
    positions = np.full((ROWS, 16), -1, np.int32)
    for r, n in enumerate(lengths):
        tokens[r, :n] = rng.integers(0, CFG.vocab_size, n)
        positions[r, :n] = np.arange(n)
    table = np.arange(ROWS * 8, dtype=np.int32).reshape(ROWS, 8)[:, ::-1].copy()  # non-trivial page order
    ids, logits, pages = greedy_programs.prefill(params, pages, tokens, positions, table, np.array(lengths) - 1,
                                                 cfg=cfg, layer_stack=stack)
    all_logits, all_ids = [np.asarray(logits)], [np.asarray(ids)]
    pos = np.array(lengths, np.int32)
    for _ in range(STEPS):
        ids, logits, pages = greedy_programs.decode(params, pages, np.asarray(ids), pos, table, cfg=cfg,
                                                    layer_stack=stack)
        all_logits.append(np.asarray(logits))
        all_ids.append(np.asarray(ids))
        pos = pos + 1
    return all_logits, np.stack(all_ids)


@pytest.fixture(scope="module")
def single_device(host_params):
    return run_greedy(host_params, None)


@pytest.mark.parametrize("spec", MESHES)
def test_mesh_equals_one_device(spec, host_params, single_device):
    ref_logits, ref_ids = single_device
    logits, ids = run_greedy(host_params, spec)
    for step, (got, want) in enumerate(zip(logits, ref_logits)):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4, f"step {step}"
    np.testing.assert_array_equal(ids, ref_ids)


@pytest.mark.parametrize("spec", MESHES)
def test_each_device_holds_its_share_of_the_weights(spec, host_params):
    _, params, _, _, _ = setup(host_params, spec)
    parsed = meshes.MeshSpec.inline(spec)
    total = sum(x.nbytes for x in jax.tree.leaves(host_params))
    fair = total / (parsed.pp * parsed.tp)
    per_device = sharding.addressable_bytes(params)
    assert len(per_device) == parsed.size
    for device, nbytes in per_device.items():
        assert abs(nbytes - fair) / fair < 0.10, (device, nbytes, fair)


def test_kv_heads_are_replicated_when_tp_exceeds_them(host_params):
    """2 KV heads over tp=8: each KV head is repeated so every shard owns one."""
    narrow = dataclasses.replace(CFG, num_kv_heads=2)
    host = jax.tree.map(np.asarray, init_params(narrow.param_specs(), jax.random.key(1), jnp.float32, scale=0.1))
    mesh = meshes.build(meshes.MeshSpec.inline("tp=8"))
    wide, params, _ = sharding.adapt_to_mesh(narrow, sharding.place(host, narrow, mesh), mesh)
    assert wide.num_kv_heads == 8
    tokens = np.arange(1, 11, dtype=np.int32)[None]
    positions = np.arange(10, dtype=np.int32)[None]
    table = np.arange(4, dtype=np.int32)[None]
    _, want, _ = greedy_programs.prefill(jax.device_put(host), init_pages(narrow, 8, PAGE, jnp.float32), tokens,
                                         positions, table, np.array([9]), cfg=narrow)
    _, got, _ = greedy_programs.prefill(
        params, init_pages(wide, 8, PAGE, jnp.float32, sharding.cache_shardings(wide, mesh)), tokens, positions, table,
        np.array([9]), cfg=wide)
    assert np.linalg.norm(np.asarray(got) - np.asarray(want)) / np.linalg.norm(np.asarray(want)) < 1e-5


def compiled_decode_hlo(host, spec):
    cfg, params, pages, stack, mesh = setup(host, spec)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    b, w = 4, 8
    return programs.decode.lower(
        abstract(params), abstract(pages), s((b,), jnp.int32), s((b,), jnp.int32), s((b, w), jnp.int32),
        *greedy_programs.abstract_sampling(b, cfg.vocab_size, rep), cfg=cfg, layer_stack=stack).compile().as_text()


@pytest.mark.parametrize("spec", ["pp=1,tp=8", "pp=2,tp=4", "pp=8,tp=1"])
def test_decode_program_has_the_expected_collectives(spec, host_params):
    hlo = compiled_decode_hlo(host_params, spec)
    parsed = meshes.MeshSpec.inline(spec)
    if parsed.tp > 1:
        assert re.search(r"\b(all-reduce|reduce-scatter)(-start)?\(", hlo), "no tensor-parallel reduction"
    if parsed.pp > 1:
        assert re.search(r"\bcollective-permute(-start)?\(", hlo), "no stage-to-stage transfer"
    # No all-gather may rebuild a whole weight matrix (one layer's, or the stack's).
    weight_shapes = set()
    for p in CFG.param_specs():
        if len(p.shape) >= 2:
            weight_shapes.add(tuple(p.shape))
            weight_shapes.add(tuple(p.shape[1:]) if p.per_layer else tuple(p.shape))
    for match in re.finditer(r"= \w+\[([\d,]*)\][^=]*? all-gather(-start)?\(", hlo):
        shape = tuple(int(d) for d in match.group(1).split(",") if d)
        assert shape not in weight_shapes, f"all-gather of a whole weight matrix {shape}"


@pytest.mark.parametrize("stages,micro", [(4, 4), (2, 2), (4, 8), (3, 5)])
def test_pipeline_schedule_keeps_every_stage_busy_after_the_fill(stages, micro):
    ticks = schedule(stages, micro)
    assert len(ticks) == micro + stages - 1
    for t, row in enumerate(ticks):
        if stages - 1 <= t < micro:  # steady state: every stage works on every tick
            assert None not in row, (t, row)
    for mb in range(micro):  # each micro-batch visits the stages in order, one tick apart
        visits = [(t, row.index(mb)) for t, row in enumerate(ticks) if mb in row]
        assert [s for _, s in visits] == list(range(stages))
        assert [t for t, _ in visits] == list(range(mb, mb + stages))
    busy = sum(x is not None for row in ticks for x in row)
    assert busy == stages * micro  # nothing computed twice, nothing skipped


def test_pp4_with_four_microbatches_schedule():
    ticks = schedule(4, 4)
    assert ticks[3] == [3, 2, 1, 0]  # after the 3-tick fill all four stages are busy
    assert ticks[0] == [0, None, None, None] and ticks[-1] == [None, None, None, 3]


@pytest.mark.parametrize("spec,why", [
    ("tp=3", "does not divide the 16 attention heads"),
    ("pp=16", "needs 16 devices"),
    ("pp=3", "does not divide the 8 layers"),
    ("dp=2,pp=2,tp=2", "dp=2 is not supported yet"),
    ("ep=2,tp=2", "ep=2 needs a model with experts"),
])
def test_meshes_that_do_not_fit_are_refused(spec, why):
    with pytest.raises(JfireError, match=why) as err:
        meshes.check_fits(meshes.MeshSpec.inline(spec), CFG, 8)
    assert "Would fit" in str(err.value)


def test_more_stages_than_layers_is_refused():
    small = dataclasses.replace(CFG, num_layers=2)
    with pytest.raises(JfireError, match="more stages than the 2 layers"):
        meshes.check_fits(meshes.MeshSpec.inline("pp=4"), small, 8)


def test_shipped_mesh_files_parse_and_the_cpu_ones_fit():
    files = meshes.mesh_files()
    names = {f.stem for f in files}
    assert {"single", "cpu-pp2-tp3", "cpu-pp3-tp3", "h200x2-llama4-scout", "h100x8-kimi-k2"} <= names
    assert "local-1p1d" not in names  # a deployment file, beside the mesh files
    for f in files:
        spec = meshes.resolve(str(f))
        assert spec.size == spec.dp * spec.pp * spec.tp * spec.ep
    from jfire.checkpoint.load import load_config_and_tokenizer

    default = load_config_and_tokenizer("default")[0]  # the CPU meshes are for the default model
    for name, devices in (("cpu-pp2-tp3", 6), ("cpu-pp3-tp3", 9)):
        meshes.check_fits(meshes.resolve(name), default, devices)
    assert meshes.resolve("h100x8-kimi-k2").devices_per_host == 8
    assert meshes.resolve("pp=2,tp=4") == meshes.MeshSpec(name="pp=2,tp=4", pp=2, tp=4)
