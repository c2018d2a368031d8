"""Expert parallelism on 8 CPU devices: experts_parallel (experts over ep, f over tp, one psum)
equals the single-device dropless result, moves activations and never gathers weights, and
runs nested inside a shard_map manual over pp, as the pipeline calls it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfire.models import moe

E, HIDDEN, FFN, TOKENS = 8, 16, 32, 6
GATE_SPEC, DOWN_SPEC = P("ep", None, "tp"), P("ep", "tp", None)


def make_mesh(pp, tp, ep):
    devices = np.array(jax.devices()[: pp * tp * ep], dtype=object).reshape(1, pp, tp, ep)
    return jax.sharding.Mesh(devices, ("dp", "pp", "tp", "ep"))


def layer(seed, scale_input):
    rng = np.random.default_rng(seed)
    draw = lambda *shape, std=1.0: jnp.asarray(std * rng.standard_normal(shape, np.float32))
    x, logits = draw(TOKENS, HIDDEN), draw(TOKENS, E)
    w = (draw(E, HIDDEN, FFN, std=0.3), draw(E, HIDDEN, FFN, std=0.3), draw(E, FFN, HIDDEN, std=0.3))
    router = moe.Router("sigmoid_input" if scale_input else "softmax_topk", 2)
    return (x, *moe.route(logits, router)), w


def single_device(tokens, w, scale_input):
    return jax.jit(moe.experts_dropless, static_argnames="scale_input")(*tokens, *w, scale_input=scale_input)


def place(mesh, w):
    return tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(w, (GATE_SPEC, GATE_SPEC, DOWN_SPEC)))


def close(actual, expected):
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("tp,ep,scale_input", [(2, 4, False), (8, 1, True), (1, 8, False)])
def test_experts_parallel_equals_single_device(tp, ep, scale_input):
    mesh = make_mesh(1, tp, ep)
    tokens, w = layer(0, scale_input)
    run = jax.jit(lambda *a: moe.experts_parallel(*a, mesh=mesh, scale_input=scale_input))
    close(run(*tokens, *place(mesh, w)), single_device(tokens, w, scale_input))


def test_experts_parallel_reduces_activations_and_never_gathers_weights():
    mesh = make_mesh(1, 2, 4)
    tokens, w = layer(1, False)
    w = place(mesh, w)
    run = jax.jit(lambda *a: moe.experts_parallel(*a, mesh=mesh, scale_input=False))
    hlo = run.lower(*tokens, *w).compile().as_text()
    assert re.search(rf"f32\[{TOKENS},{HIDDEN}\]\{{[0-9,]*\}} all-reduce\(", hlo), "expected one psum of [t, e]"
    # An all-gather of any expert-weight-shaped (3-D) operand would mean the weights moved.
    assert not weight_gathers(hlo)
    # The check can fail: weights arriving sharded otherwise are gathered to fit the specs.
    elsewhere = tuple(jax.device_put(a, NamedSharding(mesh, P(None, ("tp", "ep")))) for a in w)
    assert weight_gathers(run.lower(*tokens, *elsewhere).compile().as_text())


def weight_gathers(hlo: str) -> list[str]:
    gathered = re.findall(r"= (\w+\[[0-9,]*\])\S* all-gather(?:-start)?\(", hlo)
    return [shape for shape in gathered if shape.count(",") == 2]


@pytest.mark.parametrize("check_vma", [False, True])
def test_experts_parallel_nested_in_pipeline_shard_map(check_vma):
    """Two pipeline stages, each with its own MoE layer, experts over ep=2 and f over tp=2
    inside each stage: the outer shard_map is manual over pp only, as jfire.pipeline's is."""
    mesh = make_mesh(2, 2, 2)
    tokens, w0 = layer(2, False)
    _, w1 = layer(3, False)
    stacked = [jnp.stack(pair) for pair in zip(w0, w1)]  # [layers=2, ...], one layer per stage
    specs = (P("pp", *GATE_SPEC), P("pp", *GATE_SPEC), P("pp", *DOWN_SPEC))
    stacked = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(stacked, specs)]

    def stage(w_gate, w_up, w_down, x, weights, experts):
        y = moe.experts_parallel(x, weights, experts, w_gate[0], w_up[0], w_down[0], mesh=mesh, scale_input=False)
        return y[None]

    run = jax.jit(jax.shard_map(stage, mesh=mesh, axis_names=frozenset({"pp"}), check_vma=check_vma,
                                in_specs=(P("pp"), P("pp"), P("pp"), P(), P(), P()), out_specs=P("pp")))
    out = run(*stacked, *tokens)
    close(out[0], single_device(tokens, w0, False))
    close(out[1], single_device(tokens, w1, False))
