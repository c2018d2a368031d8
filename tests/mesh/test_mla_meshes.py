"""A DeepSeek-V3-shaped model (latent attention, a dense first layer, grouped routing, shared
experts; once with int4 and once with FP8 routed experts) on 8 CPU devices against one device: the same logits
and greedy tokens, and the latent cache stored once per token across each pipeline stage's
devices (pages split over ep x tp), never repeated on every device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.models.deepseek import DeepseekV3Config
from jfire.models.params import init_params
from tests.mesh import greedy

CFG = DeepseekV3Config(
    architecture="DeepseekV3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=96,
    moe_intermediate_size=64, num_layers=5, num_heads=8, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256, num_experts=8, experts_per_token=2,
    num_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1)
CFG_INT4 = dataclasses.replace(CFG, int4_group_size=32)
# Experts twice as wide, so each tp shard holds a whole 128-wide FP8 scale block.
CFG_FP8 = dataclasses.replace(CFG, fp8_experts=True, moe_intermediate_size=256)
CASES = [(CFG, "ep=4,tp=2"), (CFG, "pp=2,ep=4"), (CFG_INT4, "ep=4,tp=2"), (CFG_FP8, "ep=4,tp=2"),
         (CFG_FP8, "pp=2,ep=2,tp=2")]  # FP8 experts inside the pipeline too
PAGE, PAGES = 4, 64


def host_params(cfg):
    return jax.tree.map(np.asarray, init_params(cfg.param_specs(), jax.random.key(0), jnp.float32, scale=0.2))


def setup(cfg, host, spec_text):
    return greedy.setup(cfg, host, spec_text, PAGES, PAGE)


def run_greedy(cfg, host, spec_text):
    # Pages out of order and spread over the pool, so every device holds some of each row's.
    table = np.random.default_rng(1).permutation(PAGES)[: greedy.ROWS * 8].astype(np.int32).reshape(greedy.ROWS, 8)
    return greedy.run_greedy(cfg, host, spec_text, table, num_pages=PAGES, page_size=PAGE)


def _quantized(cfg):
    return "int4-" if cfg.int4_group_size else "fp8-" if cfg.fp8_experts else ""


@pytest.fixture(scope="module")
def single_device():
    cache = {}

    def get(cfg):
        if cfg not in cache:
            cache[cfg] = run_greedy(cfg, host_params(cfg), None)
        return cache[cfg]

    return get


@pytest.mark.parametrize("cfg,spec", CASES, ids=[f"{_quantized(c)}{s}" for c, s in CASES])
def test_mla_mesh_equals_one_device(cfg, spec, single_device):
    greedy.assert_same_run(run_greedy(cfg, host_params(cfg), spec), single_device(cfg))


@pytest.mark.parametrize("spec", ["ep=4,tp=2", "pp=2,ep=4"])
def test_latent_cache_is_stored_once_per_stage(spec):
    cfg, _, pages, _, _, mesh = setup(CFG, host_params(CFG), spec)
    per_token = CFG.latent_width * 4  # float32 latent + rope key, per layer
    assert CFG.kv_bytes_per_token(jnp.float32) == per_token * CFG.num_layers
    stage_devices = mesh.shape["ep"] * mesh.shape["tp"]
    for name, layers, piped in (("latent", CFG.num_layers - 1, True), ("latent_dense", 1, False)):
        array = pages[name]
        assert array.nbytes == layers * PAGES * PAGE * per_token
        for shard in array.addressable_shards:
            # Pages split over the stage's ep x tp devices; the MoE layers' array also over pp.
            split = stage_devices * (mesh.shape["pp"] if piped else 1)
            assert shard.data.nbytes * split == array.nbytes, (name, shard.device, shard.data.shape)
