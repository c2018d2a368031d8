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

from jfire import programs
from jfire.models.llama import LlamaConfig
from jfire.models.llama4 import Llama4Config
from jfire.models.params import get_path, init_params
from tests import greedy_programs
from tests.mesh import greedy

# Mixtral-shaped: 8 experts, top-2, every layer routed.
CFG = LlamaConfig(architecture="MixtralForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=96,
                  num_layers=4, num_heads=8, num_kv_heads=4, head_dim=8, max_position_embeddings=256,
                  num_experts=8, experts_per_token=2, moe_intermediate_size=96, router="softmax_topk")
MESHES = ["ep=4,tp=2", "pp=2,ep=2,tp=2", "ep=8"]
PAGE, PAGES = 4, 64
ROWS = greedy.ROWS
EXPERT_PARAMS = ("layers.we_gate", "layers.we_up", "layers.we_down")
# Llama 4 Maverick-shaped: MoE every second layer, NoPE layers 3 and 7 (global, temperature
# tuned, in the global cache group's arrays `k`/`v`), chunked attention on the others (in
# `k_chunked`/`v_chunked`); one periodic segment (dense, moe) scanned per period, the group
# scanned data. At pp=2 each stage holds two periods and its slice of each group's arrays:
# stage 1's layers 4-6 sit at 0-2 of its 3 chunked layers, layer 7 at 0 of its 1 global layer.
LLAMA4 = Llama4Config(architecture="Llama4ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=48,
                      intermediate_size_mlp=96, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=8,
                      max_position_embeddings=256, num_experts=8, experts_per_token=1, moe_layers=(1, 3, 5, 7),
                      rope_layers=(0, 1, 2, 4, 5, 6), attention_chunk_size=4, floor_scale=4.0, attn_scale=0.25)


@pytest.fixture(scope="module")
def host_params():
    return jax.tree.map(np.asarray, init_params(CFG.param_specs(), jax.random.key(0), jnp.float32, scale=0.2))


def setup(host, spec_text):
    return greedy.setup(CFG, host, spec_text, PAGES, PAGE)


def run_greedy(host, spec_text):
    table = np.arange(ROWS * 8, dtype=np.int32).reshape(ROWS, 8)[:, ::-1].copy()
    return greedy.run_greedy(CFG, host, spec_text, table, num_pages=PAGES, page_size=PAGE)


@pytest.fixture(scope="module")
def single_device(host_params):
    return run_greedy(host_params, None)


@pytest.mark.parametrize("spec", MESHES)
def test_moe_mesh_equals_one_device(spec, host_params, single_device):
    greedy.assert_same_run(run_greedy(host_params, spec), single_device)


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
        *greedy_programs.abstract_sampling(b, cfg.vocab_size, rep), cfg=cfg, layer_stack=stack,
        parallel=parallel).compile().as_text()
    # The experts' combine: an all-reduce of the [tokens, embed] activations over the ep x tp group.
    assert re.search(rf"f32\[{b},{CFG.hidden_size}\][^\n]*all-reduce", hlo), "no expert exchange collective"
    expert_shapes = set()
    for name in EXPERT_PARAMS:
        shape = get_path(params, name).shape
        expert_shapes |= {tuple(shape), tuple(shape[1:])}
    for match in re.finditer(r"= \w+\[([\d,]*)\][^=]*? all-gather(-start)?\(", hlo):
        shape = tuple(int(d) for d in match.group(1).split(",") if d)
        assert shape not in expert_shapes, f"all-gather of expert weights {shape}"


@pytest.fixture(scope="module")
def llama4_host():
    return jax.tree.map(np.asarray, init_params(LLAMA4.param_specs(), jax.random.key(1), jnp.float32, scale=0.2))


def test_periodic_llama4_at_pp2_ep2_tp2_equals_one_device(llama4_host):
    (segment,) = LLAMA4.segments()
    assert (segment.period, segment.steps) == (("dense", "moe"), 4)
    # [rows, 2 groups x 8]: each group's pages in its own pool, in an order of its own.
    table = np.arange(ROWS * 8, dtype=np.int32).reshape(ROWS, 8)
    table = np.concatenate([table[:, ::-1], table + ROWS * 8], axis=1)
    run = lambda spec: greedy.run_greedy(LLAMA4, llama4_host, spec, table, num_pages=PAGES, page_size=PAGE)
    _, params, pages, _, _, mesh = greedy.setup(LLAMA4, llama4_host, "pp=2,ep=2,tp=2", PAGES, PAGE)
    experts = get_path(params, "layers.moe1.we_gate")  # [periods, experts, embed, ffn]
    for shard in experts.addressable_shards:
        assert shard.data.shape == (2, LLAMA4.num_experts // 2, LLAMA4.hidden_size, LLAMA4.intermediate_size // 2)
    for name, stage_layers in (("k", 1), ("k_chunked", 3)):  # a stage's layers of each group
        assert {shard.data.shape[0] for shard in pages[name].addressable_shards} == {stage_layers}
    greedy.assert_same_run(run("pp=2,ep=2,tp=2"), run(None))
