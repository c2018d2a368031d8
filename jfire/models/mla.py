"""The DeepSeek-V3 layer: multi-head latent attention over the paged latent cache, then a
dense MLP or routed experts plus shared experts.

Attention runs in the absorbed form for decode and short prefill chunks: the key half of
`kv_b_proj` (W_UK) is folded into the query and the value half (W_UV) applied after, so
attention reads only the cached latent and rope key (jfire.kernels.mla_attention). With the
engine's kernels, long prefill chunks run the expanded form instead (per-head keys and
values built from the latent once a step, then multi-head flash attention: 320 against
1,088 values per score and position at DeepSeek-V3's widths, plus the expansion of the
context); `prefill_expanded` picks by the FLOP rule in jfire.kernels.mla_attention.

Sequence-sharded pages: the latent has no head axis, so splitting heads over tp would hold
every token's latent on every device. Instead the cache's pages are split over the stage's
devices (`ep` x `tp`): each device writes the tokens whose page it holds and attends over
its own pages for all heads, and one exact log-sum-exp merge (a pmax and two psums of
[b, t, h] and [b, t, h, c]) combines them. The projections around attention stay tensor
parallel over heads as usual.

Einsum letters: b batch, t tokens, e embed, h heads, d per-head width, c latent, r rope.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jfire.kernels import mla_attention
from jfire.models.blocks import (
    DecodeRows,
    apply_rope,
    apply_rope_interleaved,
    cache_slots,
    gated_mlp,
    out_projection,
    rms_norm,
    rope_angles,
    rope_inv_freq,
)
from jfire.models.family import scan_layers

PAGE_AXES = ("ep", "tp")  # the mesh axes the latent pages are split over (sharding.RULES["latent_pages"])


def softmax_scale(cfg) -> float:
    """(qk_nope + qk_rope)^-0.5, times YaRN's mscale^2 when `mscale_all_dim` is set."""
    from jfire.models.blocks import yarn_mscale

    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.yarn is not None and cfg.yarn.mscale_all_dim:
        m = yarn_mscale(cfg.yarn.factor, cfg.yarn.mscale_all_dim)
        scale *= m * m
    return scale


def _rope_tables(cfg, positions):
    if cfg.yarn is None:
        cos, sin = rope_angles(positions, rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, None))
        return cos, sin
    cos, sin = rope_angles(positions, cfg.yarn.inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta))
    factor = np.float32(cfg.yarn.cos_sin_factor())
    return cos * factor, sin * factor


def run_segment(
    cfg,
    segment,
    stack: dict,
    x,
    positions,
    pages: dict,
    page_table,
    layer_offset,
    cache_offset,
    *,
    attention_impl=None,
    parallel=None,
):
    """One segment's stacked layers over x [b, t, e]; layer j of the stack reads and writes
    layer cache_offset + j of its segment's latent array."""
    name = "latent" if segment.piped else "latent_dense"
    cache = pages[name]
    cos, sin = _rope_tables(cfg, positions)
    rope = apply_rope_interleaved if cfg.rope_interleave else apply_rope
    scale = softmax_scale(cfg)
    num_pages = cache.shape[1] * _page_ways(parallel)
    page, slot = cache_slots(positions, page_table, num_pages, cache.shape[2])
    Dn, C = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    moe = segment.kind == "moe"
    expanded = prefill_expanded(cfg, attention_impl, x.shape[1], page_table.shape[1] * cache.shape[2])

    def layer(carry, p, j):
        x, cache = carry
        i = cache_offset + j
        with jax.named_scope("attention"):
            h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            if cfg.q_lora_rank:
                q_low = rms_norm(jnp.einsum("bte,eq->btq", h, p["wq_a"]), p["q_a_norm"], cfg.rms_norm_eps)
                q = jnp.einsum("btq,qhd->bthd", q_low, p["wq_b"])
            else:
                q = jnp.einsum("bte,ehd->bthd", h, p["wq"])
            q_nope, q_rope = q[..., :Dn], rope(q[..., Dn:], cos, sin)
            kv = jnp.einsum("bte,ec->btc", h, p["wkv_a"])
            latent = rms_norm(kv[..., :C], p["kv_a_norm"], cfg.rms_norm_eps)
            k_rope = rope(kv[..., None, C:], cos, sin)[:, :, 0]
            entry = jnp.concatenate([latent, k_rope], axis=-1)  # [b, t, c + r]: what the cache keeps
            q_latent = jnp.einsum("bthd,chd->bthc", q_nope, p["wkv_b"][..., :Dn])  # unused (DCE) when expanded
            out, cache = attend(
                q_latent,
                q_rope,
                entry,
                cache,
                i,
                page,
                slot,
                page_table,
                positions,
                scale=scale,
                attention_impl=attention_impl,
                parallel=parallel,
                expand=(q_nope, p["wkv_b"]) if expanded else None,
            )
            if expanded:  # already per head in the value space
                out = out.astype(x.dtype)
            else:
                out = jnp.einsum("bthc,chd->bthd", out.astype(x.dtype), p["wkv_b"][..., Dn:])
            x = x + out_projection(out, p["wo"])
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        if moe:
            from jfire.models.experts import routed_experts
            from jfire.models.moe import Router

            with jax.named_scope("experts"):
                router = Router(
                    "sigmoid_grouped",
                    cfg.experts_per_token,
                    cfg.norm_topk_prob,
                    n_group=cfg.n_group,
                    topk_group=cfg.topk_group,
                    scaling=cfg.routed_scaling_factor,
                )
                routed = routed_experts(
                    h,
                    p["router"],
                    p["we_gate"],
                    p["we_up"],
                    p["we_down"],
                    router=router,
                    bias=p["router_bias"],
                    parallel=parallel,
                )
                x = x + routed
                if cfg.num_shared_experts:
                    x = x + gated_mlp(h, p["ws_gate"], p["ws_up"], p["ws_down"])
        else:
            with jax.named_scope("mlp"):
                x = x + gated_mlp(h, p["w_gate"], p["w_up"], p["w_down"])
        return (x, cache), None

    x, cache = scan_layers(
        layer, stack, (x, cache), x.dtype, first=layer_offset if isinstance(layer_offset, int) else None
    )
    return x, {**pages, name: cache}


def attend(
    q_latent,
    q_rope,
    entry,
    cache,
    layer,
    page,
    slot,
    page_table,
    positions,
    *,
    scale,
    attention_impl=None,
    parallel=None,
    expand=None,
):
    """Writes entry [b, t, c + r] at (page, slot) and attends: returns (out [b, t, h, c]
    float32, cache). Over a mesh the cache's pages are split over PAGE_AXES (see the module
    docstring); queries enter replicated and the merged output leaves replicated.

    With `expand` = (q_nope [b, t, h, dn], wkv_b [c, h, dn + dv]) the engine's kernel runs
    the expanded form instead (`prefill_expanded` chose it): out is then [b, t, h, dv],
    W_UV already applied, and q_latent goes unused."""
    partial = _partial_fn(attention_impl)

    def local(q_latent, q_rope, entry, cache, layer, page, slot, page_table, positions, expand, first_page, axis_name):
        cache = mla_attention.write_latent(cache, layer, page, slot, entry, first_page)
        extra = {} if expand is None else {"expand": expand}
        acc, m, l = partial(
            q_latent, q_rope, cache, layer, page_table, positions, scale=scale, first_page=first_page, **extra
        )
        return mla_attention.combine_partials(acc, m, l, axis_name), cache

    if parallel is None:
        return local(q_latent, q_rope, entry, cache, layer, page, slot, page_table, positions, expand, 0, None)

    # Every traced value enters as an argument: inside the pipeline's shard_map a value
    # closed over from outside would carry the outer mesh's axis types.
    def shard(q_latent, q_rope, entry, cache, layer, page, slot, page_table, positions, expand):
        first = jax.lax.axis_index(PAGE_AXES) * cache.shape[1]
        return local(q_latent, q_rope, entry, cache, layer, page, slot, page_table, positions, expand, first, PAGE_AXES)

    cache_spec = P(None, PAGE_AXES, None, None)
    expand_spec = None if expand is None else (P(), P())
    return jax.shard_map(
        shard,
        mesh=parallel.shard_map_mesh(),
        axis_names=frozenset(PAGE_AXES),
        in_specs=(P(), P(), P(), cache_spec, P(), P(), P(), P(), P(), expand_spec),
        out_specs=(P(), cache_spec),
    )(q_latent, q_rope, entry, cache, jnp.asarray(layer, jnp.int32), page, slot, page_table, positions, expand)


def prefill_expanded(cfg, attention_impl, tokens: int, context: int) -> bool:
    """Whether a step of `tokens` queries a row runs MLA in the expanded form: only with the
    engine's kernels (`--attention pallas`) and when jfire.kernels.mla_attention's FLOP rule
    finds it cheaper at the longest prefix the page table allows (`context` positions; the
    cached length is traced, the choice static). Below ~171 tokens at DeepSeek-V3's widths
    the absorbed form stays; above, the expanded form is cheaper at every prefix."""
    if getattr(attention_impl, "mla", None) is None or tokens <= 1 or isinstance(attention_impl, DecodeRows):
        return False
    form = mla_attention.mla_prefill_form(
        tokens,
        max(0, context - tokens),
        heads=cfg.num_heads,
        latent=cfg.kv_lora_rank,
        rope=cfg.qk_rope_head_dim,
        nope=cfg.qk_nope_head_dim,
        v=cfg.v_head_dim,
    )
    return form == "expanded"


def _partial_fn(attention_impl):
    """The partial attention: the engine's kernels when it asked for them (`attention_impl.mla`:
    the decode kernel for one-token steps, the prefill kernel for chunks), else the jnp reference."""
    kernel = getattr(attention_impl, "mla", None)
    return kernel if kernel is not None else mla_attention.mla_partial_reference


def _page_ways(parallel) -> int:
    if parallel is None:
        return 1
    shape = dict(parallel.mesh.shape)
    return int(np.prod([shape.get(a, 1) for a in PAGE_AXES]))
