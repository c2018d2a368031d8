"""Mixture-of-experts building blocks shared by the MoE families: routing, SwiGLU experts
computed dropless with a grouped matmul, a dense all-experts reference, and expert
parallelism over the mesh's `ep` (and `tp`) axes.

Einsum letters:
  t tokens, e embed (hidden), f expert ffn width, E experts (all, or those a shard holds),
  k experts chosen per token, a assignments (t * k, sorted by expert).

Expert weights are in x out: w_gate, w_up [E, e, f], w_down [E, f, e]. An expert computes
(silu(x @ gate) * (x @ up)) @ down, as transformers' Mixtral, Qwen3-MoE and Llama 4 do.
The routing weights scale the expert's output (Mixtral, Qwen3-MoE) or its input (Llama 4,
whose experts see x * score); the caller adds any shared expert.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

ROUTER_KINDS = ("softmax_topk", "softmax", "sigmoid_input", "sigmoid_grouped")


@dataclasses.dataclass(frozen=True)
class Router:
    """How a family turns router logits into k (weight, expert) pairs per token.

    softmax_topk   Mixtral: softmax over all experts, top-k, always renormalised over the k.
    softmax        Qwen3-MoE: softmax over all experts, top-k, renormalised if `renormalize`
                   (HF `norm_topk_prob`).
    sigmoid_input  Llama 4: top-k of the raw logits, sigmoid of the chosen ones; the score
                   multiplies the expert's input (use `scale_input=True`).
    sigmoid_grouped  DeepSeek-V3: sigmoid scores (float32 logits); a per-expert bias is added
                   only to choose experts, within the best `topk_group` of `n_group` groups
                   (a group ranked by its two best biased scores); the chosen experts'
                   unbiased scores, renormalised if `renormalize`, times `scaling`.
    """

    kind: str
    top_k: int
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0

    def __post_init__(self):
        if self.kind not in ROUTER_KINDS:
            raise ValueError(f"router kind {self.kind!r}: expected one of {ROUTER_KINDS}")
        if self.top_k < 1:
            raise ValueError(f"router top_k must be >= 1, got {self.top_k}")
        if self.kind == "sigmoid_input" and self.renormalize:
            raise ValueError("sigmoid_input (Llama 4) scores are not renormalised")

    @property
    def scale_input(self) -> bool:
        return self.kind == "sigmoid_input"


def route(logits: jax.Array, router: Router, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits [t, E] (as the model's router matmul gives them, in the model dtype;
    float32 for sigmoid_grouped) -> (weights [t, k] float32, experts [t, k] int32). `bias`
    [E] is sigmoid_grouped's choice-only correction.

    The weights stay float32, as Mixtral's do. HF rounds Qwen3-MoE's weights
    (`.to(router_logits.dtype)`) and Llama 4's scores (`.to(router_scores.dtype)`) to the
    model dtype before use: a bf16 model that wants HF's rounding casts them
    (`weights.astype(x.dtype)`); the expert functions multiply in float32, which is exact
    for a product of two bf16 values, so that cast reproduces HF's bf16 product.
    """
    with jax.named_scope("route"):
        if router.kind == "sigmoid_input":
            # Llama4Router: torch.topk on the raw logits in their own dtype, then
            # sigmoid(float32); the unchosen experts get sigmoid(-inf) = 0 there, i.e. a zero
            # input, and an expert maps zero to zero, so dropping them is exact.
            top, experts = jax.lax.top_k(logits, router.top_k)
            return jax.nn.sigmoid(top.astype(jnp.float32)), experts.astype(jnp.int32)
        if router.kind == "sigmoid_grouped":
            return _route_grouped(logits.astype(jnp.float32), router, bias)
        # Mixtral (`softmax(logits.float())`) and Qwen3-MoE (`softmax(logits, dtype=float)`)
        # both upcast before the softmax, over all E experts (not just the chosen k), and
        # take the top-k of the probabilities.
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, router.top_k)
        if router.kind == "softmax_topk" or router.renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts.astype(jnp.int32)


def _route_grouped(logits, router: Router, bias):
    """DeepSeek-V3's noaux_tc routing, as DeepseekV3TopkRouter computes it."""
    t, num = logits.shape
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if router.n_group > 1:
        groups = choice.reshape(t, router.n_group, num // router.n_group)
        group_scores = jax.lax.top_k(groups, 2)[0].sum(axis=-1)  # [t, groups]
        _, best = jax.lax.top_k(group_scores, router.topk_group)
        keep = jnp.zeros((t, router.n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
        choice = jnp.where(jnp.repeat(keep, num // router.n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, router.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if router.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * router.scaling, experts.astype(jnp.int32)


def _swiglu_grouped(xs, sizes, w_gate, w_up, w_down):
    """Rows xs [a, e] sorted by expert, sizes[E] rows per expert -> [a, e] (float32).

    XLA:CPU has no grouped matmul: jax 0.10.2 lowers ragged_dot there as a dense emulation
    (lhs broadcast to [E, a, e] with each group's rows masked in, one dot contracting over
    (e, E) that first copies the whole weight to [e, E, f] on every call), i.e. E times a
    grouped matmul's FLOPs. Rows past sum(sizes) come out zero there; the GPU and TPU
    lowerings (chlo.ragged_dot) promise nothing we have checked for them, so the caller
    masks them."""
    gate = _ragged_dot(xs, w_gate, sizes)  # [a, f]
    up = _ragged_dot(xs, w_up, sizes)  # [a, f]
    h = (jax.nn.silu(gate) * up).astype(xs.dtype)
    return _ragged_dot(h, w_down, sizes)  # [a, e]


def _ragged_dot(xs, w, sizes):
    """xs [a, in] by group through w [E, in, out], or through quantized expert weights that stay
    quantized on the device, in their source's [E, out, in] layout: packed int4 {"packed",
    "scale"} (jfire.kernels.int4_experts) or block-scaled FP8 {"fp8", "scale_inv"}
    (jfire.models.fp8_experts).

    The impl is `int4_experts.default_impl()`: on a GPU "pallas", where every kind runs a Pallas
    grouped matmul that reads only the experts with rows (int4: jfire.kernels.int4_experts, which
    unpacks tiles as it multiplies; bf16/f32 and FP8: jfire.kernels.grouped_matmul, FP8 tiles
    scaled as they are read); elsewhere "xla": XLA's ragged_dot, quantized layers dequantized
    first. `int4_experts.use_impl` overrides it ("xla" keeps XLA's ragged_dot on a GPU; "tiled",
    for `jfire plan`, loops over the quantized experts and leaves bf16 ones to XLA)."""
    from jfire.kernels.int4_experts import default_impl

    impl = default_impl()
    if isinstance(w, dict) and "packed" in w:
        from jfire.kernels.int4_experts import ragged_dot_int4

        return ragged_dot_int4(xs, w["packed"], w["scale"], sizes, impl=impl)
    if isinstance(w, dict):
        from jfire.models.fp8_experts import ragged_dot_fp8

        return ragged_dot_fp8(xs, w["fp8"], w["scale_inv"], sizes, impl=impl)
    if impl in ("pallas", "pallas-interpret"):
        from jfire.kernels import grouped_matmul

        if grouped_matmul.fits(w):
            return grouped_matmul.grouped_matmul(xs, w, sizes, interpret=impl == "pallas-interpret")
    return jax.lax.ragged_dot(xs, w, sizes, preferred_element_type=jnp.float32)


def _dropless_f32(x, weights, experts, w_gate, w_up, w_down, scale_input, first_expert):
    t, e = x.shape
    k = experts.shape[1]
    num_local = num_experts(w_gate)
    local = experts.reshape(-1) - first_expert  # [a] expert ids relative to this shard
    mine = (local >= 0) & (local < num_local)
    # Assignments to other shards' experts sort to the end under key num_local, beyond
    # every group, so no group computes them.
    key = jnp.where(mine, local, num_local)
    order = jnp.argsort(key, stable=True)  # [a]
    sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)  # [E]
    token = order // k  # assignment a came from token a // k
    w_sorted = weights.reshape(-1)[order].astype(jnp.float32)  # [a]
    xs = x[token]  # [a, e]
    if scale_input:
        # Llama 4 scales the input in the model dtype: x * score, rounded once.
        xs = (xs.astype(jnp.float32) * w_sorted[:, None]).astype(x.dtype)
    ys = _swiglu_grouped(xs, sizes, w_gate, w_up, w_down)  # [a, e]
    # Mask the rows no group owns (see _swiglu_grouped); a select, so garbage NaNs vanish too.
    ys = jnp.where(mine[order][:, None], ys, 0.0)
    if not scale_input:
        ys = ys * w_sorted[:, None]
    # Scatter-add back to the tokens: the sum over each token's k experts.
    return jnp.zeros((t, e), jnp.float32).at[token].add(ys)


def experts_dropless(x, weights, experts, w_gate, w_up, w_down, *, scale_input: bool, first_expert=0):
    """SwiGLU experts on the tokens routed to them, nothing dropped: the t*k assignments
    sorted by expert and multiplied by a grouped matmul over group sizes (`_ragged_dot`).

    x [t, e]; weights, experts [t, k]; w_gate, w_up [E, e, f]; w_down [E, f, e] -> [t, e].
    A shard holding only experts [first_expert, first_expert + E) passes its slice of the
    weights and its first expert id (may be traced, e.g. from `axis_index`): assignments to
    other experts contribute exactly zero, so the shards' results sum to the whole.
    """
    with jax.named_scope("experts_dropless"):
        out = _dropless_f32(x, weights, experts, w_gate, w_up, w_down, scale_input, first_expert)
        return out.astype(x.dtype)


def experts_dense_reference(x, weights, experts, w_gate, w_up, w_down, *, scale_input: bool, first_expert=0):
    """The same result with every expert computed on every token (plain einsums): the
    independent reference for tests and the dense baseline for benchmarks."""
    with jax.named_scope("experts_dense"):
        num_local = w_gate.shape[0]
        local = experts - first_expert  # [t, k]
        # combine[t, E]: token t's weight for expert E, zero where not chosen.
        onehot = jax.nn.one_hot(local, num_local, dtype=jnp.float32)  # [t, k, E], zero off-shard
        combine = jnp.einsum("tk,tkE->tE", weights.astype(jnp.float32), onehot)
        # Experts lead every operand ([E, t, e], not [t, E, e]): XLA:CPU then runs one
        # batched matmul per projection without transposing the weights (measured 2.7x
        # faster at t=16 than the token-major layout).
        if scale_input:
            xin = (x.astype(jnp.float32)[None] * combine.T[:, :, None]).astype(x.dtype)  # [E, t, e]
        else:
            xin = jnp.broadcast_to(x[None], (num_local, *x.shape))
        gate = jnp.einsum("Ete,Eef->Etf", xin, w_gate, preferred_element_type=jnp.float32)
        up = jnp.einsum("Ete,Eef->Etf", xin, w_up, preferred_element_type=jnp.float32)
        h = (jax.nn.silu(gate) * up).astype(x.dtype)
        y = jnp.einsum("Etf,Efe->Ete", h, w_down, preferred_element_type=jnp.float32)
        if scale_input:
            out = jnp.sum(y, axis=0)  # unchosen experts saw a zero input and give zero
        else:
            out = jnp.einsum("tE,Ete->te", combine, y)
        return out.astype(x.dtype)


def experts_parallel(
    x, weights, experts, w_gate, w_up, w_down, *, mesh, scale_input: bool, ep_axis: str = "ep", tp_axis: str = "tp"
):
    """Expert parallelism: experts split over `ep_axis`, each expert's f width over `tp_axis`.

    Tokens (x, weights, experts) enter replicated; the weights stay where they are,
    w_gate / w_up sharded P(ep, None, tp) and w_down P(ep, tp, None). Each shard runs
    `experts_dropless` on its own experts for the tokens routed to them and its slice of f
    (SwiGLU is elementwise in f, so the f slices' down projections are partial sums), and
    one psum over (ep, tp) combines them.

    Why replicated tokens + psum rather than an all-to-all dispatch: decode batches are
    small (t of 1-256), so the psum moves t*e float32 activations per layer, never weights,
    about what sending the t*k routed rows out and back would; the multiplies are the same
    either way (each shard takes only the assignments routed to its experts). A dropless
    all-to-all needs `ragged_all_to_all`, which XLA:CPU does not implement (DESIGN.md), and
    a padded one moves worst-case buffers.

    `mesh` is the concrete `jax.sharding.Mesh` the program was built for; this also works
    inside another shard_map manual over other axes (the pipeline's, over `pp`).
    """
    from jfire.kernels.varying import shard_map_mesh

    axes = (ep_axis, tp_axis)
    mesh = shard_map_mesh(mesh)

    def shard(x, weights, experts, w_gate, w_up, w_down):
        first = jax.lax.axis_index(ep_axis) * num_experts(w_gate)
        part = _dropless_f32(x, weights, experts, w_gate, w_up, w_down, scale_input, first)
        # Sum in float32: a bf16 psum would round every shard's partial sum.
        return jax.lax.psum(part, axes).astype(x.dtype)

    with jax.named_scope("experts_parallel"):
        return jax.shard_map(
            shard,
            mesh=mesh,
            axis_names=frozenset(axes),
            in_specs=(
                P(),
                P(),
                P(),
                _expert_spec(w_gate, "in_out", ep_axis, tp_axis),
                _expert_spec(w_up, "in_out", ep_axis, tp_axis),
                _expert_spec(w_down, "out_in", ep_axis, tp_axis),
            ),
            out_specs=P(),
        )(x, weights, experts, w_gate, w_up, w_down)


def num_experts(w) -> int:
    """Experts in a weight: a plain [E, ...] array or a quantized subtree ({"packed", "scale"},
    {"fp8", "scale_inv"}), every leaf [E, ...]."""
    return (next(iter(w.values())) if isinstance(w, dict) else w).shape[0]


def _expert_spec(w, width: str, ep_axis: str, tp_axis: str):
    """How one expert weight enters the expert-parallel shard_map: experts over ep, the ffn
    width over tp. `width` says where the ffn axis is in the plain [E, in, out] layout:
    "in_out" (gate/up: out is ffn) or "out_in" (down: in is ffn). Quantized experts keep
    the source's [E, out, in] layout (their scales too), so their ffn axis is the other one."""
    if isinstance(w, dict):
        spec = P(ep_axis, tp_axis, None) if width == "in_out" else P(ep_axis, None, tp_axis)
        return {name: spec for name in w}
    return P(ep_axis, None, tp_axis) if width == "in_out" else P(ep_axis, tp_axis, None)
