"""Blocks every family composes: norms, rotary positions, the gated MLP, paged cache writes,
the LM head, and `PreNormFamily`, the decoder and logits of the pre-norm families.

Einsum letters: b batch, t query tokens, e embed, h heads, d head dim, f ffn.
Each is written once, the way transformers computes it (float32 where the reference is).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jfire.errors import JfireError
from jfire.models.family import CacheSpec, Family, Segment, run_segments


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: "linear" or "llama3"."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_params(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from a HF config (transformers 5 folds both into rope_parameters)."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(rope["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope.get("low_freq_factor", 1.0)),
            float(rope.get("high_freq_factor", 4.0)),
            int(rope.get("original_max_position_embeddings", 8192)),
        )
    raise JfireError(f"unsupported rope scaling {kind!r}; jfire supports 'default', 'linear' and 'llama3'")


def rope_inv_freq(head_dim: int, theta: float, s: RopeScaling | None) -> np.ndarray:
    """Inverse rotary frequencies [d/2], computed the way transformers does (float32)."""
    inv = (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))).astype(
        np.float32
    )
    if s is None:
        return inv
    if s.kind == "linear":
        return (inv / s.factor).astype(np.float32)
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    # Scout's config has high == low factor: an empty band, whose blend is never used.
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN rotary scaling (DeepSeek-V3, Kimi K2): frequencies blended between interpolated and
    original by a linear ramp over the dimensions, and an attention factor on cos/sin."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, rope: Mapping[str, Any], max_position_embeddings: int) -> Yarn:
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor")
        return cls(
            factor=float(factor) if factor is not None else max_position_embeddings / original,
            original_max_position_embeddings=original,
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=rope.get("mscale"),
            mscale_all_dim=rope.get("mscale_all_dim"),
            attention_factor=rope.get("attention_factor"),
            truncate=bool(rope.get("truncate", True)),
        )

    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_factor`)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, dim: int, theta: float) -> np.ndarray:
        """Inverse frequencies [dim/2] as transformers' `_compute_yarn_parameters` makes them."""

        def correction_dim(rotations):
            return (
                dim
                * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta))
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as the reference: no zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        pos_freqs = (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)).astype(np.float32)
        extrapolation = (1.0 / pos_freqs).astype(np.float32)
        interpolation = (1.0 / (self.factor * pos_freqs)).astype(np.float32)
        keep = (1 - ramp).astype(np.float32)  # 1: keep the original frequency
        return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_angles(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [b, t, d/2] for positions [b, t]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates halves (the HF Llama layout). x [b, t, h, d]; cos/sin [b, t, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates adjacent pairs (x[2i], x[2i+1]) as complex numbers (Llama 4, DeepSeek)."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(x.shape).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm: normalise in float32, scale in the activation dtype, as the reference does.
    weight None is the weightless form (Llama 4's q/k L2 norm)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype) if weight is None else weight * x32.astype(x.dtype)


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU: (silu(x W_gate) * x W_up) W_down. x [..., e]; w_gate/w_up [e, f]; w_down [f, e]."""
    gate = jax.nn.silu(jnp.einsum("...e,ef->...f", x, w_gate))
    up = jnp.einsum("...e,ef->...f", x, w_up)
    return jnp.einsum("...f,fe->...e", gate * up, w_down)


def layer_matmul(x: jax.Array, p, name: str, n_in: int = 1) -> jax.Array:
    """x [..., in...] through the layer weight p[name] [in..., out...], whose first n_in dims
    contract with x's last n_in (`flat_matmul`). Where `p` is a `StackedLayer` and the CPU
    kernels apply, the product reads the layer straight from the stack (jfire.kernels.cpu_matmul),
    or from its palette-coded form (jfire.kernels.cpu_palette)."""
    return layer_matmuls(x, p, (name,), n_in)[0]


def layer_matmuls(x: jax.Array, p, names, n_in: int = 1) -> tuple[jax.Array, ...]:
    """`layer_matmul` of one input by several weights (a layer's q, k and v, or its gate and
    up): on the CPU kernels, one call for all of them."""
    from jfire.kernels import cpu_matmul, cpu_palette
    from jfire.kernels.layer_weights import CODED, FusedPalette, fused_matmul
    from jfire.models.family import StackedLayer

    if isinstance(p, StackedLayer):
        stacks = [p.stack[name] for name in names]
        lead, k = x.shape[: x.ndim - n_in], math.prod(x.shape[x.ndim - n_in :])
        fused = [isinstance(s, FusedPalette) and s.coded.layout.row_axes == n_in for s in stacks]
        if any(fused):
            if len(names) > 1:
                return tuple(layer_matmuls(x, p, (name,), n_in)[0] for name in names)
            w = stacks[0]
            if math.prod(lead) <= w.max_rows:
                y = fused_matmul(x.reshape(math.prod(lead), k), w, p.index)
                return (y.reshape(*lead, *w.coded.layout.shape[1 + n_in :]),)
            return (flat_matmul(x, p[names[0]], n_in),)  # decoded first: a product too large to gain
        if any(isinstance(s, CODED) for s in stacks):  # other coded leaves: decoded as they are read
            return tuple(flat_matmul(x, p[name], n_in) for name in names)
        coded = [isinstance(s, cpu_palette.CpuPalette) for s in stacks]
        if any(coded) and not all(coded):
            return tuple(layer_matmuls(x, p, (name,), n_in)[0] for name in names)
        if all(coded):
            if cpu_matmul.applies(math.prod(lead), x, *stacks):
                return cpu_palette.stacked_matmuls(x.reshape(*lead, k), stacks, p.index)
        elif cpu_matmul.applies(math.prod(lead), x, *stacks):
            flat = [s.reshape(s.shape[0], k, math.prod(s.shape[1 + n_in :])) for s in stacks]
            outs = cpu_matmul.stacked_matmuls(x.reshape(*lead, k), flat, p.index)
            return tuple(y.reshape(*lead, *s.shape[1 + n_in :]) for y, s in zip(outs, stacks))
    return tuple(flat_matmul(x, p[name], n_in) for name in names)


def flat_matmul(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """x [..., in...] @ w [in..., out...] over the n_in input dims, as one 2-D product (XLA:CPU
    otherwise transposes a weight with several input dims on every call)."""
    lead, k = x.shape[: x.ndim - n_in], math.prod(x.shape[x.ndim - n_in :])
    out_dims = w.shape[n_in:]
    y = jnp.einsum("...k,kn->...n", x.reshape(*lead, k), w.reshape(k, math.prod(out_dims)))
    return y.reshape(*lead, *out_dims)


def cache_slots(positions: jax.Array, page_table: jax.Array, num_pages: int, page_size: int):
    """(page, slot) [b, t] each token's cache entry is written to. Padding (position -1) is
    sent to page `num_pages`, past the pool, where a scatter with mode="drop" discards it."""
    rows = jnp.arange(positions.shape[0])[:, None]
    valid = positions >= 0
    safe = jnp.where(valid, positions, 0)
    page = jnp.where(valid, jnp.asarray(page_table)[rows, safe // page_size], num_pages)
    return page, safe % page_size


def write_heads(pages: jax.Array, layer, page, slot, values: jax.Array) -> jax.Array:
    """Writes values [b, t, k, d] into pages [layers, k, num_pages, page_size, d] at layer."""
    # Indexed [layer, :, page, slot] the update is [b, t, k, d]: the values' own layout.
    return pages.at[layer, :, page, slot].set(values.astype(pages.dtype), mode="drop")


def out_projection(out: jax.Array, wo: jax.Array) -> jax.Array:
    """Attention output [b, t, h, d] through wo [h, d, e]: one contraction over h*d."""
    return flat_matmul(out, wo, n_in=2)


def lm_head(x: jax.Array, params: dict, tied: bool) -> jax.Array:
    """Float32 logits from the final hidden states (tied: through the embedding). In a verify
    step (`cpu_matmul.decode_rows`: x [t, b, e]) the product takes the path a decode step of b
    rows takes: the kernel over every row where it serves b rows (a row's sums do not depend on
    the rows beside it), else XLA's dot of b rows once per position."""
    from jfire.kernels import cpu_matmul, cpu_palette

    step_rows = cpu_matmul.decode_rows_now()
    with jax.named_scope("lm_head"):
        if tied:
            embed = params["embed"]
            rows = step_rows or math.prod(x.shape[:-1])
            if cpu_matmul.applies(rows, x, embed, max_rows=cpu_matmul.head_max_rows(embed)):
                if isinstance(embed, cpu_palette.CpuPaletteTable):
                    return cpu_palette.matmul_nt(x, embed)
                return cpu_matmul.matmul_nt(x, embed)
            if isinstance(embed, cpu_palette.CpuPaletteTable):
                embed = embed.decoded()

            def head(x):
                return jnp.einsum("...e,ve->...v", x, embed, preferred_element_type=jnp.float32)
        else:

            def head(x):
                return jnp.einsum("...e,ev->...v", x, params["lm_head"], preferred_element_type=jnp.float32)

        if step_rows and x.ndim == 3:
            return jnp.stack([head(x[j]) for j in range(x.shape[0])])
        return head(x)


@dataclasses.dataclass(frozen=True)
class DecodeRows:
    """Attention of t query tokens a row computed as t decode rows: the query at each position
    attends on its own, through the attention decode uses (`inner`, the engine's kernels, or
    None: the family's own), with the row's page table and its position. A speculative verify
    step (jfire.speculative.verify) runs its k + 1 tokens a row so, so that each position's
    output is the one a decode step would compute, in the same order of sums; a prefill
    chunk's attention, a batch of matrix products, may sum in another order.

    The family's layer calls `attention_fn(attention_impl, default)`; multi-head latent
    attention finds the decode rows through `mla`."""

    inner: Any = None

    def bind(self, default):
        attend = self.inner or default
        # An attention that can take the t tokens a row as decode rows itself (the CPU kernel:
        # it reads a row's cache once for all of them) says so with `decode_rows`.
        together = getattr(attend, "decode_rows", None)

        def rows(q, k_pages, v_pages, layer, page_table, positions, sliding_window=None, chunk=None):
            t = q.shape[1]
            if together is not None and chunk is None:
                out = together(q, k_pages, v_pages, layer, page_table, positions, sliding_window=sliding_window)
                if out is not None:
                    return out
            out = attend(
                _one_query(q),
                k_pages,
                v_pages,
                layer,
                jnp.repeat(page_table, t, axis=0),
                _one_query(positions),
                sliding_window=sliding_window,
                chunk=chunk,
            )
            return _t_queries(out, t)

        return rows

    def mla(self, q_latent, q_rope, cache, layer, page_table, positions, *, scale, first_page=0):
        """The latent-cache partial (acc, m, l) of each position as a decode row's."""
        from jfire.kernels.mla_attention import mla_partial_reference

        partial = getattr(self.inner, "mla", None) or mla_partial_reference
        t = q_latent.shape[1]
        table = jnp.repeat(page_table, t, axis=0)
        acc, m, l = partial(
            _one_query(q_latent),
            _one_query(q_rope),
            cache,
            layer,
            table,
            _one_query(positions),
            scale=scale,
            first_page=first_page,
        )
        return _t_queries(acc, t), _t_queries(m, t), _t_queries(l, t)


def _one_query(x):
    """[b, t, ...] as b * t rows of one query: [b * t, 1, ...]."""
    return x.reshape(x.shape[0] * x.shape[1], 1, *x.shape[2:])


def _t_queries(x, t: int):
    """[b * t, 1, ...] back to [b, t, ...]."""
    return x.reshape(x.shape[0] // t, t, *x.shape[2:])


def attention_fn(attention_impl, default):
    """The attention a layer calls: the engine's (`attention_impl`: the Pallas kernels, or
    `DecodeRows` around them) or the family's `default`."""
    if isinstance(attention_impl, DecodeRows):
        return attention_impl.bind(default)
    return attention_impl or default


# -- grouped-query attention: its cache, its mesh constraints ------------------------------------


def kv_cache_specs(
    num_layers: int, num_kv_heads: int, head_dim: int, group: str = "full", suffix: str = ""
) -> tuple[CacheSpec, ...]:
    """Keys and values per KV head: [layers, kv_heads, pages, page_slots, head_dim] each, named
    `k{suffix}` and `v{suffix}`, their pages owned by cache group `group`."""
    axes = ("layers", "kv_heads", "pages", "page_slots", "head_dim")
    sizes = (num_layers, num_kv_heads, None, None, head_dim)
    return (CacheSpec("k" + suffix, axes, sizes, group), CacheSpec("v" + suffix, axes, sizes, group))


def gqa_mesh_problems(num_heads: int, num_kv_heads: int, tp: int) -> list[str]:
    problems = []
    if num_heads % tp:
        problems.append(f"tp={tp} does not divide the {num_heads} attention heads")
    if num_kv_heads % tp and tp % num_kv_heads:
        problems.append(f"tp={tp} and the {num_kv_heads} KV heads do not divide one another")
    return problems


def repeat_kv_heads(cfg, tp: int):
    """(cfg, r) for a tp-way mesh: with tp > KV heads each KV head is repeated r times so every
    tp shard owns one. Query head h uses KV head h // (H / K); after repeating each KV head r
    times in place, h // (H / (K r)) names a copy of that same head, so attention is unchanged."""
    r = tp // cfg.num_kv_heads if tp > cfg.num_kv_heads else 1
    return (dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r) if r > 1 else cfg), r


class PreNormFamily(Family):
    """The pre-norm families (Llama, Llama 4, DeepSeek): embedding, every segment's layers,
    final RMSNorm, LM head. `decoder` and `logits` are written once here; a family supplies
    its scanned layer loop as the method `run_segment`, and the fields read below."""

    rms_norm_eps: float
    tie_word_embeddings: bool

    def run_segment(
        self,
        segment: Segment,
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
        """One segment's stacked layers over activations x [b, t, e]; returns (x, the
        segment's cache arrays). See `jfire.models.family.run_segments` for the offsets."""
        raise NotImplementedError

    def decoder(
        self,
        params,
        tokens,
        positions,
        pages,
        page_table,
        *,
        attention_impl=None,
        layer_stack=None,
        parallel=None,
        embeds=None,
    ):
        # [b, t, e], in the cache's dtype: bfloat16 rows widen to float32 beside bfloat16
        # weights on the CPU (jfire.checkpoint.load.LoadedModel.kv_dtype), and stay as they are
        # where the cache has the weights' dtype.
        x = params["embed"][tokens].astype(jax.tree.leaves(pages)[0].dtype)
        if embeds is not None:
            # `embeds` = (values [b, t, e], mask [b, t]): an image's encoder output takes the place
            # of its placeholder tokens' embeddings, as transformers' masked_scatter does; cast
            # like the token rows so both meet the layers in one dtype.
            values, mask = embeds
            x = jnp.where(mask[..., None], values.astype(x.dtype), x)
        x, pages = run_segments(
            self,
            params,
            x,
            positions,
            pages,
            page_table,
            run=type(self).run_segment,
            attention_impl=attention_impl,
            layer_stack=layer_stack,
            parallel=parallel,
        )
        return rms_norm(x, params["final_norm"], self.rms_norm_eps), pages

    def logits(self, params, hidden):
        return lm_head(hidden, params, self.tie_word_embeddings)
