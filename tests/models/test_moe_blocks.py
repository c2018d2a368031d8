"""MoE building blocks against transformers' own MoE modules (torch, CPU, float32): each
family's router and sparse MoE block with tiny random weights, copied into jax arrays.
Then dropless (ragged_dot) = dense all-experts reference, and shards summing to the whole."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.llama4 import modeling_llama4
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe

from jfire.models import moe

HIDDEN, FFN, TOKENS = 16, 24, 7


def close(actual, expected, rtol=1e-5):
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def randomize(module, seed):
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module.eval()


def hf_case(name):
    """(HF MoE block, Router, router weight [e, E], w_gate, w_up [E, e, f], w_down [E, f, e])."""
    if name == "mixtral":
        cfg = modeling_mixtral.MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=8,
                                             num_experts_per_tok=2, experts_implementation="eager")
        block, router = randomize(modeling_mixtral.MixtralSparseMoeBlock(cfg), 0), moe.Router("softmax_topk", 2)
    elif name.startswith("qwen3"):
        norm = name == "qwen3_norm"
        cfg = modeling_qwen3_moe.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=FFN, num_experts=8,
                                                num_experts_per_tok=3, norm_topk_prob=norm,
                                                experts_implementation="eager")
        block, router = randomize(modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg), 1), moe.Router("softmax", 3, norm)
    else:
        cfg = modeling_llama4.Llama4TextConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=4,
                                               num_experts_per_tok=2)
        block, router = randomize(modeling_llama4.Llama4TextMoe(cfg), 2), moe.Router("sigmoid_input", 2)
        with torch.no_grad():  # the shared expert is the caller's business: make it give zero
            for p in block.shared_expert.parameters():
                p.zero_()
        # Llama 4 stores experts fused and in x out: gate_up_proj [E, e, 2f], down_proj [E, f, e].
        gate_up, down = block.experts.gate_up_proj.detach().numpy(), block.experts.down_proj.detach().numpy()
        return (block, router, block.router.weight.detach().numpy().T,
                gate_up[..., :FFN], gate_up[..., FFN:], down)
    # Mixtral / Qwen3-MoE: gate_up_proj [E, 2f, e] (gate rows first), down_proj [E, e, f], out x in.
    gate_up, down = block.experts.gate_up_proj.detach().numpy(), block.experts.down_proj.detach().numpy()
    return (block, router, block.gate.weight.detach().numpy().T,
            gate_up[:, :FFN].transpose(0, 2, 1), gate_up[:, FFN:].transpose(0, 2, 1), down.transpose(0, 2, 1))


CASES = ["mixtral", "qwen3", "qwen3_norm", "llama4"]


def tokens(seed=3):
    return np.random.default_rng(seed).standard_normal((TOKENS, HIDDEN)).astype(np.float32)


@pytest.mark.parametrize("name", CASES)
def test_route_matches_hf_router(name):
    block, router, *_ = hf_case(name)
    x = torch.from_numpy(tokens())
    with torch.no_grad():
        if name == "llama4":
            hf_scores, logits = block.router(x)  # dense [t, E]: sigmoid(-inf) = 0 off the top-k
        else:
            logits, hf_weights, hf_experts = block.gate(x)
    weights, experts = moe.route(jnp.asarray(logits.numpy()), router)
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32
    if name == "llama4":
        dense = np.zeros(hf_scores.shape, np.float32)
        np.put_along_axis(dense, np.asarray(experts), np.asarray(weights), axis=1)
        close(dense, hf_scores.numpy(), rtol=1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(experts), hf_experts.numpy())
        close(weights, hf_weights.numpy(), rtol=1e-6)
    if router.kind == "softmax_topk" or router.renormalize:
        close(weights.sum(-1), np.ones(TOKENS), rtol=1e-6)
    elif router.kind == "softmax":
        assert float(weights.sum(-1).max()) < 1.0  # Qwen3 without norm_topk_prob keeps raw probabilities


@pytest.mark.parametrize("name", CASES)
def test_moe_block_matches_hf(name):
    block, router, w_router, w_gate, w_up, w_down = hf_case(name)
    x = tokens()
    with torch.no_grad():
        hf = block(torch.from_numpy(x)[None])
    hf = (hf[0] if isinstance(hf, tuple) else hf).reshape(TOKENS, HIDDEN).numpy()
    weights, experts = moe.route(jnp.asarray(x) @ w_router, router)
    args = (jnp.asarray(x), weights, experts, jnp.asarray(w_gate), jnp.asarray(w_up), jnp.asarray(w_down))
    close(moe.experts_dropless(*args, scale_input=router.scale_input), hf)
    close(moe.experts_dense_reference(*args, scale_input=router.scale_input), hf)


def random_layer(seed, t, num_experts=8, dtype=jnp.float32):
    """x [t, e], router logits [t, E], (w_gate, w_up, w_down); numpy draws (no jax RNG compiles)."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape, std=1.0: jnp.asarray(std * rng.standard_normal(shape, np.float32))
    w = [draw(num_experts, HIDDEN, FFN, std=0.3), draw(num_experts, HIDDEN, FFN, std=0.3),
         draw(num_experts, FFN, HIDDEN, std=0.3)]
    return draw(t, HIDDEN).astype(dtype), draw(t, num_experts), [a.astype(dtype) for a in w]


@pytest.mark.parametrize("scale_input", [False, True])
def test_dropless_equals_dense_and_shards_sum_to_whole(scale_input):
    x, logits, (w_gate, w_up, w_down) = random_layer(4, t=9)
    weights, experts = moe.route(logits, moe.Router("sigmoid_input" if scale_input else "softmax_topk", 2))
    dropless = jax.jit(moe.experts_dropless, static_argnames="scale_input")
    dense = jax.jit(moe.experts_dense_reference, static_argnames="scale_input")
    full = dense(x, weights, experts, w_gate, w_up, w_down, scale_input=scale_input)
    close(dropless(x, weights, experts, w_gate, w_up, w_down, scale_input=scale_input), full)
    # Four shards of two experts each; first_expert traced, as experts_parallel passes it.
    parts = []
    for first in range(0, 8, 2):
        sl = slice(first, first + 2)
        part = dropless(x, weights, experts, w_gate[sl], w_up[sl], w_down[sl], scale_input=scale_input,
                        first_expert=jnp.int32(first))
        ref = dense(x, weights, experts, w_gate[sl], w_up[sl], w_down[sl], scale_input=scale_input,
                    first_expert=jnp.int32(first))
        close(part, ref)
        parts.append(part)
    close(sum(parts), full)
    # Tokens routed to none of a shard's experts get exactly zero from it.
    mine = np.isin(np.asarray(experts), [2, 3]).any(1)
    assert not np.asarray(parts[1])[~mine].any()


def test_dropless_bfloat16_close_to_float32():
    x, logits, w = random_layer(5, t=6, dtype=jnp.bfloat16)
    weights, experts = moe.route(logits, moe.Router("softmax", 2, renormalize=True))
    got = jax.jit(moe.experts_dropless, static_argnames="scale_input")(x, weights, experts, *w, scale_input=False)
    assert got.dtype == jnp.bfloat16
    f32 = [a.astype(jnp.float32) for a in (x, *w)]
    want = jax.jit(moe.experts_dense_reference, static_argnames="scale_input")(
        f32[0], weights, experts, *f32[1:], scale_input=False)
    close(got.astype(jnp.float32), want, rtol=2e-2)


def test_router_rejects_bad_kinds():
    with pytest.raises(ValueError, match="router kind"):
        moe.Router("top1", 1)
    with pytest.raises(ValueError, match="renormalised"):
        moe.Router("sigmoid_input", 1, renormalize=True)
