"""A mixture-of-experts model on 8 CPU devices against one device: the same logits and greedy
tokens with experts over ep (with tp, and with pipeline stages), the expert exchange in the
compiled decode program without any all-gather of expert weights, and each device holding
1/ep of the expert weights."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire import mesh as meshes
from jfire import programs, sharding
from jfire.kv_cache import init_pages
from jfire.models.family import Parallel
from jfire.models.llama import LlamaConfig
from jfire.models.params import get_path, init_params
from jfire.pipeline import Pipeline

# Mixtral-shaped: 8 experts, top-2, every layer routed.
CFG = LlamaConfig(architecture="MixtralForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=96,
                  num_layers=4, num_heads=8, num_kv_heads=4, head_dim=8, max_position_embeddings=256,
                  num_experts=8, experts_per_token=2, moe_intermediate_size=96, router="softmax_topk")
MESHES = ["ep=4,tp=2", "pp=2,ep=2,tp=2", "ep=8"]
PAGE, PAGES = 4, 64
ROWS, STEPS = 4, 6
EXPERT_PARAMS = ("layers.we_gate", "layers.we_up", "layers.we_down")


@pytest.fixture(scope="module")
def host_params():
    return jax.tree.map(np.asarray, init_params(CFG.param_specs(), jax.random.key(0), jnp.float32, scale=0.2))


def setup(host, spec_text):
    if spec_text is None:
        return CFG, jax.device_put(host), init_pages(CFG, PAGES, PAGE, jnp.float32), None, None, None
    spec = meshes.MeshSpec.inline(spec_text)
    meshes.check_fits(spec, CFG, jax.device_count())
    mesh = meshes.build(spec)
    cfg, params, _ = sharding.adapt_to_mesh(CFG, sharding.place(host, CFG, mesh), mesh)
    pages = init_pages(cfg, PAGES, PAGE, jnp.float32, sharding.cache_shardings(cfg, mesh))
    stack = Pipeline(mesh, spec.num_microbatches) if spec.pp > 1 else None
    return cfg, params, pages, stack, Parallel(mesh), mesh


def run_greedy(host, spec_text):
    cfg, params, pages, stack, parallel, _ = setup(host, spec_text)
    rng = np.random.default_rng(0)
    lengths = [12, 5, 9, 1]
    tokens = np.zeros((ROWS, 16), np.int32)
    positions = np.full((ROWS, 16), -1, np.int32)
    for r, n in enumerate(lengths):
        tokens[r, :n] = rng.integers(0, CFG.vocab_size, n)
        positions[r, :n] = np.arange(n)
    table = np.arange(ROWS * 8, dtype=np.int32).reshape(ROWS, 8)[:, ::-1].copy()
    knobs = (np.zeros(ROWS, np.uint32), np.zeros(ROWS, np.float32), np.zeros(ROWS, np.int32), np.ones(ROWS, np.float32))
    ids, logits, pages = programs.prefill(params, pages, tokens, positions, table, np.array(lengths) - 1, *knobs,
                                          cfg=cfg, layer_stack=stack, parallel=parallel)
    all_logits, all_ids = [np.asarray(logits)], [np.asarray(ids)]
    pos = np.array(lengths, np.int32)
    for _ in range(STEPS):
        ids, logits, pages = programs.decode(params, pages, np.asarray(ids), pos, table, *knobs, cfg=cfg,
                                             layer_stack=stack, parallel=parallel)
        all_logits.append(np.asarray(logits))
        all_ids.append(np.asarray(ids))
        pos = pos + 1
    return all_logits, np.stack(all_ids)


@pytest.fixture(scope="module")
def single_device(host_params):
    return run_greedy(host_params, None)


@pytest.mark.parametrize("spec", MESHES)
def test_moe_mesh_equals_one_device(spec, host_params, single_device):
    ref_logits, ref_ids = single_device
    logits, ids = run_greedy(host_params, spec)
    for step, (got, want) in enumerate(zip(logits, ref_logits)):
        for row in range(ROWS):  # per row: one bad position cannot hide behind the others
            err = np.linalg.norm(got[row] - want[row]) / np.linalg.norm(want[row])
            assert err < 1e-4, (step, row, err)
    np.testing.assert_array_equal(ids, ref_ids)


@pytest.mark.parametrize("spec", MESHES)
def test_each_device_holds_one_ep_th_of_the_experts(spec, host_params):
    _, params, _, _, _, mesh = setup(host_params, spec)
    ep = mesh.shape["ep"]
    for name in EXPERT_PARAMS:
        array = get_path(params, name)
        total = array.nbytes
        for shard in array.addressable_shards:
            # Experts split over ep, their width over tp, layers over pp: every device has 1/(ep*tp*pp).
            assert shard.data.nbytes * ep * mesh.shape["tp"] * mesh.shape["pp"] == total, (name, shard.device)
            experts = shard.data.shape[1]
            assert experts == CFG.num_experts // ep


@pytest.mark.parametrize("spec", ["ep=4,tp=2", "ep=8"])
def test_decode_exchanges_activations_never_expert_weights(spec, host_params):
    cfg, params, pages, stack, parallel, mesh = setup(host_params, spec)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    b, w = 4, 8
    hlo = programs.decode.lower(
        abstract(params), abstract(pages), s((b,), jnp.int32), s((b,), jnp.int32), s((b, w), jnp.int32),
        s((b,), jnp.uint32), s((b,), jnp.float32), s((b,), jnp.int32), s((b,), jnp.float32),
        cfg=cfg, layer_stack=stack, parallel=parallel).compile().as_text()
    # The experts' combine: an all-reduce of the [tokens, embed] activations over the ep x tp group.
    assert re.search(rf"f32\[{b},{CFG.hidden_size}\][^\n]*all-reduce", hlo), "no expert exchange collective"
    expert_shapes = set()
    for name in EXPERT_PARAMS:
        shape = get_path(params, name).shape
        expert_shapes |= {tuple(shape), tuple(shape[1:])}
    for match in re.finditer(r"= \w+\[([\d,]*)\][^=]*? all-gather(-start)?\(", hlo):
        shape = tuple(int(d) for d in match.group(1).split(",") if d)
        assert shape not in expert_shapes, f"all-gather of expert weights {shape}"
