"""EAGLE-3 draft heads (Li et al., "EAGLE-3: Scaling up Inference Acceleration of LLMs via
Training-Time Test", 2025): one decoder layer that drafts tokens from the target model's own
hidden states. Loaded from the released Hugging Face layouts by jfire.checkpoint.eagle3_load.

The head as vLLM (`llama_eagle3.py`), SGLang (`llama_eagle3.py`, `kimi_k25_eagle3.py`) and the
trainers (EAGLE's `cnets.py`, SpecForge, TorchSpec, ModelOpt) compute it:

    g      = fc(concat(a_1, .., a_n))                  n target hidden states -> [H]   (`fuse`)
    x_in   = concat(rms(e, input_layernorm), rms(g, hidden_norm))         [2H]: q/k/v read both
    x      = g + o_proj(attention(x_in))               (residual rms(g) if norm_before_residual)
    out    = x + mlp(rms(x, post_attention_layernorm))
    logits = lm_head(rms(out, norm))                   draft vocabulary; target id = d + d2t[d]

e is the embedding of the token, g the fused target hidden state of the position before it.
`out`, before the final norm, is the hidden state the next draft step feeds back in place of
g. The attention is grouped-query (Llama-style heads) or DeepSeek's multi-head latent
attention (`kimi-k2.5-eagle3-mla`, `Kimi-K2.5-Thinking-Eagle3`), whose q/kv down-projections
then take the 2H input; the MLA pieces are jfire.models.mla's.

Pairing, as the trainers and vLLM/SGLang feed it: the draft row at position p holds the target
hidden state computed at position p together with the token at p + 1 (the token that hidden
state predicted), and its logits predict the token at p + 2. Positions are the target's, so a
step's cache entries sit at the same positions as the target's own.

Einsum letters: b batch, t tokens, e embed (H), x the 2H attention input, h heads, d per-head
width, c latent, f ffn, v (draft) vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jfire.errors import JfireError
from jfire.kernels.cpu_attention import paged_attention
from jfire.kernels.cpu_palette import CpuPaletteTable
from jfire.models import mla
from jfire.models.blocks import (
    RopeScaling,
    Yarn,
    apply_rope,
    apply_rope_interleaved,
    cache_slots,
    flat_matmul,
    gated_mlp,
    kv_cache_specs,
    out_projection,
    rms_norm,
    rope_angles,
    rope_inv_freq,
    rope_params,
    write_heads,
)
from jfire.models.family import CacheSpec
from jfire.models.params import ParamSpec

LLAMA_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM", "Eagle3Speculator")
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM",)
# Where the one decoder layer's tensors live: EAGLE/SpecForge/ModelOpt/TorchSpec write
# `midlayer.`, vLLM-exported and speculators checkpoints `layers.0.`, a few `model.layers.0.`.
LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")
# Flags of other EAGLE variants this module does not compute; each is refused by name.
_UNSUPPORTED_FLAGS = {
    "fc_norm": "EAGLE 3.1's per-chunk norm before fc",
    "use_aux_norm": "EAGLE 3.1's per-chunk norm before fc",
    "norm_output": "EAGLE 3.1's post-norm hidden output",
    "attention_bias": "q/k/v/o biases",
    "mlp_bias": "MLP biases",
    "bias": "an fc bias",
    "tie_word_embeddings": "an lm_head tied to the embedding",
}


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """One EAGLE-3 head. `attention` is "gqa" (Llama-style heads) or "mla" (DeepSeek latent).
    `layer_prefix` / `prefix` are where the checkpoint keeps its tensors (the loader fills them
    from the names it finds). Static and hashable: pass it to `jax.jit` as a static argument."""

    architecture: str
    attention: str
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    vocab_size: int  # the target's: embedding rows and the range of d2t's targets
    draft_vocab_size: int  # lm_head rows
    num_heads: int
    num_kv_heads: int = 0
    head_dim: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    yarn: Yarn | None = None
    rope_interleave: bool = False
    norm_before_residual: bool = False
    num_aux: int = 3
    aux_layer_ids: tuple[int, ...] | None = None  # as the config states them (see target_hidden_indices)
    layer_prefix: str = "midlayer."
    prefix: str = ""

    def __post_init__(self):
        if self.attention not in ("gqa", "mla"):
            raise JfireError(f"EAGLE-3 attention must be 'gqa' or 'mla', not {self.attention!r}")
        if self.attention == "gqa" and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            raise JfireError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise JfireError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})")

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Eagle3Config:
        """The head of a draft `config.json`: the EAGLE/SpecForge/ModelOpt layout (`eagle_config`
        nested), vLLM speculators' (`transformer_layer_config` nested), or TorchSpec's MLA one."""
        hf = _flatten(hf)
        arch = (hf.get("architectures") or ["LlamaForCausalLMEagle3"])[0]
        mla_head = arch in MLA_ARCHITECTURES or "kv_lora_rank" in hf
        if not mla_head and arch not in LLAMA_ARCHITECTURES:
            raise JfireError(
                f"unsupported EAGLE-3 architecture {arch!r}; jfire reads "
                + ", ".join((*LLAMA_ARCHITECTURES, *MLA_ARCHITECTURES))
            )
        _refuse_unsupported(hf)
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        theta, scaling, yarn = _rope(hf)
        ids = hf.get("eagle_aux_hidden_state_layer_ids")
        common = dict(
            architecture=arch,
            hidden_size=hidden,
            target_hidden_size=int(hf.get("target_hidden_size") or hidden),
            intermediate_size=int(
                hf["intermediate_size_mlp"] if hf.get("model_type") == "llama4_text" else hf["intermediate_size"]
            ),
            vocab_size=int(hf["vocab_size"]),
            draft_vocab_size=int(hf.get("draft_vocab_size") or hf["vocab_size"]),
            num_heads=heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            yarn=yarn,
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
            num_aux=len(ids) if ids else 3,
            aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
        )
        if mla_head:
            return cls(
                attention="mla",
                q_lora_rank=int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None,
                kv_lora_rank=int(hf["kv_lora_rank"]),
                qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                v_head_dim=int(hf["v_head_dim"]),
                rope_interleave=bool(hf.get("rope_interleave", True)),
                **common,
            )
        return cls(
            attention="gqa",
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            **common,
        )

    # -- declarations ---------------------------------------------------------------------------

    def param_specs(self) -> tuple[ParamSpec, ...]:
        """Every tensor the head needs, with its HF name: `fc`, the layer, `norm`, `lm_head`.
        The optional ones (`embed_tokens`, `d2t`) are `optional_specs()`."""
        E, Et, F, V = self.hidden_size, self.target_hidden_size, self.intermediate_size, self.draft_vocab_size
        top, layer = self.prefix, self.layer_prefix

        def lin(name, shape, axes, hf, n_in=1):
            return ParamSpec(name, shape, axes, hf, None, n_in=n_in)

        def norm(name, size, axis, hf):
            return ParamSpec(name, (size,), (axis,), hf, None, init="ones")

        specs = [
            lin("fc", (self.num_aux * Et, E), ("embed", "embed"), top + "fc.weight"),
            norm("layer.input_norm", E, "embed", layer + "input_layernorm.weight"),
            norm("layer.hidden_norm", E, "embed", layer + "hidden_norm.weight"),
            *self._attention_specs(),
            norm("layer.mlp_norm", E, "embed", layer + "post_attention_layernorm.weight"),
            lin("layer.w_gate", (E, F), ("embed", "ffn"), layer + "mlp.gate_proj.weight"),
            lin("layer.w_up", (E, F), ("embed", "ffn"), layer + "mlp.up_proj.weight"),
            lin("layer.w_down", (F, E), ("ffn", "embed"), layer + "mlp.down_proj.weight"),
            norm("norm", E, "embed", top + "norm.weight"),
            lin("lm_head", (E, V), ("embed", "vocab"), "lm_head.weight"),
        ]
        return tuple(specs)

    def optional_specs(self) -> tuple[ParamSpec, ...]:
        """The head's own embedding (else the target's is used) and the draft-to-target id
        offsets (else identity: the draft vocabulary is the target's)."""
        return (
            ParamSpec(
                "embed",
                (self.vocab_size, self.hidden_size),
                ("vocab", "embed"),
                self.prefix + "embed_tokens.weight",
                None,
                flat_source=False,
            ),
            ParamSpec("d2t", (self.draft_vocab_size,), ("vocab",), "d2t", None, init="zeros", dtype="int32"),
        )

    def _attention_specs(self) -> list[ParamSpec]:
        X, E, H, layer = 2 * self.hidden_size, self.hidden_size, self.num_heads, self.layer_prefix + "self_attn."

        def lin(name, shape, axes, hf, n_in=1):
            return ParamSpec("layer." + name, shape, axes, layer + hf, None, n_in=n_in)

        if self.attention == "gqa":
            K, D = self.num_kv_heads, self.head_dim
            return [
                lin("wq", (X, H, D), ("embed", "q_heads", "head_dim"), "q_proj.weight"),
                lin("wk", (X, K, D), ("embed", "kv_heads", "head_dim"), "k_proj.weight"),
                lin("wv", (X, K, D), ("embed", "kv_heads", "head_dim"), "v_proj.weight"),
                lin("wo", (H, D, E), ("q_heads", "head_dim", "embed"), "o_proj.weight", n_in=2),
            ]
        C, R, Dn, Dv = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
        if self.q_lora_rank:
            Q = self.q_lora_rank
            q = [
                lin("wq_a", (X, Q), ("embed", "q_lora"), "q_a_proj.weight"),
                ParamSpec("layer.q_a_norm", (Q,), ("q_lora",), layer + "q_a_layernorm.weight", None, init="ones"),
                lin("wq_b", (Q, H, Dn + R), ("q_lora_in", "q_heads", "mla_head_dim"), "q_b_proj.weight"),
            ]
        else:
            q = [lin("wq", (X, H, Dn + R), ("embed", "q_heads", "mla_head_dim"), "q_proj.weight")]
        return [
            *q,
            lin("wkv_a", (X, C + R), ("embed", "latent"), "kv_a_proj_with_mqa.weight"),
            ParamSpec("layer.kv_a_norm", (C,), ("latent",), layer + "kv_a_layernorm.weight", None, init="ones"),
            lin("wkv_b", (C, H, Dn + Dv), ("latent", "q_heads", "mla_head_dim"), "kv_b_proj.weight"),
            lin("wo", (H, Dv, E), ("q_heads", "head_dim", "embed"), "o_proj.weight", n_in=2),
        ]

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """The draft's own one-layer paged cache: keys and values per KV head, or MLA's latent
        plus rope key per token (no head axis), in the target's page format."""
        if self.attention == "gqa":
            return kv_cache_specs(1, self.num_kv_heads, self.head_dim)
        width = self.kv_lora_rank + self.qk_rope_head_dim
        return (CacheSpec("latent", ("layers", "latent_pages", "page_slots", "latent"), (1, None, None, width)),)

    def target_hidden_indices(self, num_target_layers: int, ids_mean: str = "layer_output") -> tuple[int, ...]:
        """Which of the target's hidden states `fuse` takes, in the order it concatenates them,
        as indices into HF's `output_hidden_states` tuple: 0 is the embedding output, i the
        output of decoder layer i - 1 (0-based), i.e. the residual stream entering layer i.

        Without ids in the config every engine takes indices (2, L // 2, L - 3) (EAGLE's own
        code, vLLM, SGLang). Stated ids are read two ways in the wild: SGLang and the trainers
        (SpecForge, TorchSpec, ModelOpt) hook each listed layer's *output* ("layer_output": index
        id + 1), vLLM captures the listed layer's *input* ("layer_input": index id). The config
        does not say which it was written for; `ids_mean` chooses. Engines concatenate in layer
        order, so the indices come back ascending."""
        L = num_target_layers
        if self.aux_layer_ids is None:
            indices = [2, L // 2, L - 3]
        elif ids_mean == "layer_output":
            indices = [i + 1 for i in self.aux_layer_ids]
        elif ids_mean == "layer_input":
            indices = list(self.aux_layer_ids)
        else:
            raise JfireError(f"ids_mean must be 'layer_output' or 'layer_input', not {ids_mean!r}")
        bad = [i for i in indices if not 0 <= i <= L]
        if bad:
            raise JfireError(f"EAGLE-3 aux hidden state indices {bad} lie outside the target's 0..{L} hidden states")
        return tuple(sorted(indices))


def _flatten(hf: Mapping[str, Any]) -> dict:
    """One flat dict of the keys the head reads: `eagle_config` and speculators'
    `transformer_layer_config` folded in (the outer keys win where both name one)."""
    flat = dict(hf.get("transformer_layer_config") or {})
    flat.update({k: v for k, v in hf.items() if k != "transformer_layer_config"})
    eagle = hf.get("eagle_config") or {}
    if not isinstance(eagle, Mapping):
        raise JfireError("config.json's 'eagle_config' must be an object")
    if eagle.get("use_aux_hidden_state") is False:
        raise JfireError("eagle_config.use_aux_hidden_state=false (an EAGLE-1/2 head) is not an EAGLE-3 head")
    for key, want in (("use_input_layernorm_in_first_layer", True), ("use_last_layernorm", True)):
        if eagle.get(key, want) is not want:
            raise JfireError(f"eagle_config.{key}={eagle[key]} is not supported (jfire computes {key}={want})")
    if eagle.get("use_mtp_layernorm"):
        raise JfireError("eagle_config.use_mtp_layernorm=true is not supported")
    if "eagle_aux_hidden_state_layer_ids" not in flat and eagle.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_aux_hidden_state_layer_ids"] = eagle["eagle_aux_hidden_state_layer_ids"]
    return flat


def _refuse_unsupported(hf: Mapping[str, Any]) -> None:
    for key, what in _UNSUPPORTED_FLAGS.items():
        if hf.get(key):
            raise JfireError(f"config.json sets {key}={hf[key]} ({what}), which jfire's EAGLE-3 head does not compute")
    layers = int(hf.get("num_hidden_layers", 1))
    if layers != 1:
        raise JfireError(f"EAGLE-3 heads have one decoder layer; this config has num_hidden_layers={layers}")
    if hf.get("hidden_act", "silu") != "silu":
        raise JfireError(f"unsupported hidden_act {hf['hidden_act']!r}; EAGLE-3 heads use 'silu'")


def _rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None, Yarn | None]:
    """(theta, Llama-style scaling, YaRN): YaRN as transformers and TorchSpec compute it (the
    Kimi heads), the rest as jfire.models.blocks.rope_params reads them."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type")) == "yarn":
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        return theta, None, Yarn.from_hf(rope, int(hf.get("max_position_embeddings", 4096)))
    theta, scaling = rope_params(hf)
    return theta, scaling, None


# -- the forward pass ---------------------------------------------------------------------------


def fuse(cfg: Eagle3Config, params: Mapping[str, Any], aux_hidden: jax.Array) -> jax.Array:
    """The first draft step's hidden input: fc over the target's hidden states at
    `cfg.target_hidden_indices(...)`, concatenated in that order. [b, t, n * Ht] -> [b, t, H]."""
    want = cfg.num_aux * cfg.target_hidden_size
    if aux_hidden.shape[-1] != want:
        raise JfireError(
            f"EAGLE-3 fuse takes {cfg.num_aux} target hidden states of {cfg.target_hidden_size} "
            f"({want} wide), got {aux_hidden.shape[-1]}"
        )
    w = params["fc"]
    return jnp.einsum("...i,ie->...e", aux_hidden.astype(w.dtype), w)


def draft_forward(
    cfg: Eagle3Config,
    params: Mapping[str, Any],
    embed: jax.Array,
    hidden: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    cache: dict,
    page_table: jax.Array,
    *,
    attention_impl=None,
) -> tuple[jax.Array, jax.Array, dict]:
    """One draft step over rows of tokens: (float32 logits [b, t, draft vocab], the layer's
    output hidden [b, t, H] before the final norm, the cache).

    embed [vocab, H]: the head's own table or the target's (`draft_embedding`). hidden
    [b, t, H]: `fuse` of the target's hidden states, or a previous step's output hidden.
    tokens, positions [b, t] (position -1 = padding: its cache write is dropped and it sees
    nothing). cache: `init_cache`'s arrays (one layer), written at the new positions before
    attention as the target's layers do; page_table [b, w] in the target's page format.
    `attention_impl` is what the matching target family takes (a paged-attention function for
    "gqa", an object with `.mla` for "mla"); None: the references."""
    p = params["layer"]
    dtype = params["fc"].dtype
    eps = cfg.rms_norm_eps
    with jax.named_scope("eagle3"):
        g = hidden.astype(dtype)
        g_normed = rms_norm(g, p["hidden_norm"], eps)
        # (A target's embedding kept palette-coded on the CPU looks its rows up itself.)
        rows = embed[tokens] if isinstance(embed, CpuPaletteTable) else jnp.asarray(embed)[tokens]
        e_normed = rms_norm(rows.astype(dtype), p["input_norm"], eps)
        x_in = jnp.concatenate([e_normed, g_normed], axis=-1)  # [b, t, 2H]: embedding first
        attend = _mla_attention if cfg.attention == "mla" else _gqa_attention
        with jax.named_scope("attention"):
            attn, cache = attend(cfg, p, x_in, positions, cache, page_table, attention_impl)
        x = (g_normed if cfg.norm_before_residual else g) + attn
        with jax.named_scope("mlp"):
            out = x + gated_mlp(rms_norm(x, p["mlp_norm"], eps), p["w_gate"], p["w_up"], p["w_down"])
        with jax.named_scope("lm_head"):
            logits = jnp.einsum(
                "bte,ev->btv", rms_norm(out, params["norm"], eps), params["lm_head"], preferred_element_type=jnp.float32
            )
    return logits, out, cache


def _rope_tables(cfg: Eagle3Config, positions: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
    if cfg.yarn is None:
        return rope_angles(positions, rope_inv_freq(dim, cfg.rope_theta, cfg.rope_scaling))
    cos, sin = rope_angles(positions, cfg.yarn.inv_freq(dim, cfg.rope_theta))
    factor = np.float32(cfg.yarn.cos_sin_factor())
    return cos * factor, sin * factor


def _gqa_attention(cfg: Eagle3Config, p, x_in, positions, cache: dict, page_table, attention_impl):
    """Llama-style attention whose q/k/v read the 2H input; returns (o_proj output, cache)."""
    cos, sin = _rope_tables(cfg, positions, cfg.head_dim)
    rope = apply_rope_interleaved if cfg.rope_interleave else apply_rope
    q = rope(flat_matmul(x_in, p["wq"]), cos, sin)  # [b, t, h, d]
    k = rope(flat_matmul(x_in, p["wk"]), cos, sin)  # [b, t, k, d]
    v = flat_matmul(x_in, p["wv"])
    page, slot = cache_slots(positions, page_table, cache["k"].shape[2], cache["k"].shape[3])
    k_pages = write_heads(cache["k"], 0, page, slot, k)
    v_pages = write_heads(cache["v"], 0, page, slot, v)
    out = (attention_impl or paged_attention)(q, k_pages, v_pages, 0, page_table, positions)
    return out_projection(out, p["wo"]), {**cache, "k": k_pages, "v": v_pages}


def _mla_attention(cfg: Eagle3Config, p, x_in, positions, cache: dict, page_table, attention_impl):
    """DeepSeek multi-head latent attention (absorbed, over the latent cache) whose q and kv
    down-projections read the 2H input; the attention itself is jfire.models.mla's."""
    Dn, C, eps = cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.rms_norm_eps
    cos, sin = _rope_tables(cfg, positions, cfg.qk_rope_head_dim)
    rope = apply_rope_interleaved if cfg.rope_interleave else apply_rope
    if cfg.q_lora_rank:
        q_low = rms_norm(jnp.einsum("btx,xq->btq", x_in, p["wq_a"]), p["q_a_norm"], eps)
        q = jnp.einsum("btq,qhd->bthd", q_low, p["wq_b"])
    else:
        q = jnp.einsum("btx,xhd->bthd", x_in, p["wq"])
    q_nope, q_rope = q[..., :Dn], rope(q[..., Dn:], cos, sin)
    kv = jnp.einsum("btx,xc->btc", x_in, p["wkv_a"])
    latent = rms_norm(kv[..., :C], p["kv_a_norm"], eps)
    k_rope = rope(kv[..., None, C:], cos, sin)[:, :, 0]
    entry = jnp.concatenate([latent, k_rope], axis=-1)  # [b, t, c + r]: what the cache keeps
    q_latent = jnp.einsum("bthd,chd->bthc", q_nope, p["wkv_b"][..., :Dn])
    pages = cache["latent"]
    page, slot = cache_slots(positions, page_table, pages.shape[1], pages.shape[2])
    out, pages = mla.attend(
        q_latent,
        q_rope,
        entry,
        pages,
        0,
        page,
        slot,
        page_table,
        positions,
        scale=mla.softmax_scale(cfg),
        attention_impl=attention_impl,
    )
    out = jnp.einsum("bthc,chd->bthd", out.astype(x_in.dtype), p["wkv_b"][..., Dn:])
    return out_projection(out, p["wo"]), {**cache, "latent": pages}


# -- around the forward -------------------------------------------------------------------------


def init_cache(cfg: Eagle3Config, num_pages: int, page_size: int, dtype=jnp.float32) -> dict:
    """Zeroed draft cache arrays as `cfg.cache_specs()` declares them."""
    return {s.name: jnp.zeros(s.shape(num_pages, page_size), dtype) for s in cfg.cache_specs()}


def draft_embedding(params: Mapping[str, Any], target_embed: jax.Array | None = None) -> jax.Array:
    """The token embedding the head drafts with: its own `embed_tokens` where the checkpoint
    ships one (as vLLM loads it), else the target's."""
    if "embed" in params:
        return params["embed"]
    if target_embed is None:
        raise JfireError("this EAGLE-3 head has no embed_tokens of its own: pass the target model's embedding")
    return target_embed


def to_target_ids(params: Mapping[str, Any], draft_ids: jax.Array) -> jax.Array:
    """Target-vocabulary ids of draft-vocabulary ids: d + d2t[d] (d2t is all zeros where the
    head drafts over the whole target vocabulary)."""
    return draft_ids + params["d2t"][draft_ids]


def target_logits(cfg: Eagle3Config, params: Mapping[str, Any], logits: jax.Array) -> jax.Array:
    """Draft logits [..., draft vocab] spread over the target vocabulary, -inf for the ids the
    head cannot draft (what vLLM's `compute_logits` returns, for probability-ratio sampling)."""
    if cfg.draft_vocab_size == cfg.vocab_size:
        return logits
    ids = to_target_ids(params, jnp.arange(cfg.draft_vocab_size))
    full = jnp.full((*logits.shape[:-1], cfg.vocab_size), -jnp.inf, logits.dtype)
    return full.at[..., ids].set(logits)
