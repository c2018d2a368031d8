"""A routed-experts layer as families use it: router logits, the choice of experts, and the
dropless expert computation, on one device or dispatched over the mesh's `ep` axis.

Einsum letters: b batch, t tokens, e embed, x experts.
"""

from __future__ import annotations

import jax.numpy as jnp

from jfire.models import moe


def routed_experts(h, router_w, we_gate, we_up, we_down, *, router: moe.Router, bias=None, parallel=None):
    """h [b, t, e] through the experts each token's router picks; returns [b, t, e].

    router_w [e, x]; we_gate/we_up [x, e, f]; we_down [x, f, e], or each a packed int4
    subtree {"packed", "scale"} (jfire.kernels.int4_experts). `bias` [x] is DeepSeek-V3's
    choice-only correction. `parallel` (a jfire.models.family.Parallel) shards the experts
    over its mesh's ep axis (and their width over tp); without it every expert is local.
    """
    b, t, e = h.shape
    x = h.reshape(b * t, e)
    if router.kind == "sigmoid_grouped":
        # DeepSeek-V3 scores in float32 from float32 inputs (its router weight is kept float32).
        logits = jnp.einsum("te,ex->tx", x.astype(jnp.float32), router_w.astype(jnp.float32))
    else:
        # The router matmul runs in the model dtype and `route` upcasts for the softmax/sigmoid,
        # as transformers does.
        logits = jnp.einsum("te,ex->tx", x, router_w)
    weights, experts = moe.route(logits, router, bias)
    if parallel is None:
        out = moe.experts_dropless(x, weights, experts, we_gate, we_up, we_down, scale_input=router.scale_input)
    else:
        out = moe.experts_parallel(
            x, weights, experts, we_gate, we_up, we_down, mesh=parallel.mesh, scale_input=router.scale_input
        )
    return out.reshape(b, t, e).astype(h.dtype)
