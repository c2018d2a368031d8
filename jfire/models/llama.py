"""The Llama family of decoders: Llama 2/3.x, Mistral, Qwen2, Qwen3 and SmolLM2.

They share one architecture (pre-norm RMSNorm, rotary positions, grouped-query attention,
SwiGLU MLP) and differ only in switches this config carries: q/k/v biases (Qwen2), q/k
norms (Qwen3), Llama-3 rope scaling, a sliding window (Mistral v0.1), tied embeddings.

Einsum letters:
  b batch, t query tokens, s key/cache slots, e embed, h query heads, k kv heads,
  g query heads per kv head, d head dim, f ffn, v vocab.

Parameters are stacked over layers (leading `layers` axis) so the layer loop is one
`lax.scan`: one compiled layer body, and a single axis for pipeline stages to split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jfire.errors import JfireError
from jfire.kernels.paged_attention import paged_attention_reference
from jfire.models.params import ParamSpec

# HF `architectures[0]` -> the name GGUF files use for the same family.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_GGUF_TO_HF = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: "linear" or "llama3" (the only kinds these families ship)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise JfireError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise JfireError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "LlamaConfig":
        """Builds the config from a Hugging Face `config.json` dict (transformers 4.x or 5.x)."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise JfireError(
                f"unsupported architecture {arch!r} in config.json; jfire supports "
                + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            )
        if hf.get("mlp_bias"):
            raise JfireError("config.json sets mlp_bias=true, which jfire does not support")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise JfireError(f"unsupported hidden_act {act!r}; the Llama family uses 'silu'")
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or {})
        legacy_scaling = hf.get("rope_scaling") or {}
        rope = {**legacy_scaling, **rope}
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        window = hf.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            if hf.get("use_sliding_window"):
                raise JfireError(f"{arch} with use_sliding_window=true is not supported")
            window = None
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=_rope_scaling(rope),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", False)) or arch == "Qwen2ForCausalLM",
            o_bias=bool(hf.get("attention_bias", False)) and arch != "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(window) if window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], has_output_tensor: bool) -> "LlamaConfig":
        """Builds the config from GGUF metadata (`general.architecture` and its `ARCH.*` keys)."""
        arch = meta.get("general.architecture")
        if arch not in _GGUF_TO_HF:
            raise JfireError(
                f"unsupported GGUF architecture {arch!r}; jfire supports " + ", ".join(sorted(_GGUF_TO_HF))
            )

        def key(name, default=None):
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise JfireError(f"GGUF metadata lacks '{arch}.{name}'")
            return value

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // num_heads)
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = None
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = RopeScaling("linear", float(meta[f"{arch}.rope.scaling.factor"]))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=_GGUF_TO_HF[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
            head_dim=head_dim,
            max_position_embeddings=int(key("context_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=not has_output_tensor,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    # -- the one declaration of parameters ------------------------------------------------

    def param_specs(self) -> tuple[ParamSpec, ...]:
        """Every parameter: shape, logical axes, and where it lives in HF and GGUF files.

        Layer parameters carry a leading `layers` axis; `{i}` in a source name is the layer.
        `n_in` marks a linear layer whose first n_in dims are inputs: HF stores it [out, in].
        """
        L, E, F, V = self.num_layers, self.hidden_size, self.intermediate_size, self.vocab_size
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        hf = "model.layers.{i}."
        specs = [
            ParamSpec("embed", (V, E), ("vocab", "embed"), "model.embed_tokens.weight", "token_embd.weight",
                      flat_source=False),
            ParamSpec("final_norm", (E,), ("embed",), "model.norm.weight", "output_norm.weight", init="ones"),
            ParamSpec("layers.attn_norm", (L, E), ("layers", "embed"), hf + "input_layernorm.weight",
                      "blk.{i}.attn_norm.weight", init="ones"),
            ParamSpec("layers.wq", (L, E, H, D), ("layers", "embed", "q_heads", "head_dim"),
                      hf + "self_attn.q_proj.weight", "blk.{i}.attn_q.weight", n_in=1),
            ParamSpec("layers.wk", (L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"),
                      hf + "self_attn.k_proj.weight", "blk.{i}.attn_k.weight", n_in=1),
            ParamSpec("layers.wv", (L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"),
                      hf + "self_attn.v_proj.weight", "blk.{i}.attn_v.weight", n_in=1),
            ParamSpec("layers.wo", (L, H, D, E), ("layers", "q_heads", "head_dim", "embed"),
                      hf + "self_attn.o_proj.weight", "blk.{i}.attn_output.weight", n_in=2),
            ParamSpec("layers.mlp_norm", (L, E), ("layers", "embed"), hf + "post_attention_layernorm.weight",
                      "blk.{i}.ffn_norm.weight", init="ones"),
            ParamSpec("layers.w_gate", (L, E, F), ("layers", "embed", "ffn"), hf + "mlp.gate_proj.weight",
                      "blk.{i}.ffn_gate.weight", n_in=1),
            ParamSpec("layers.w_up", (L, E, F), ("layers", "embed", "ffn"), hf + "mlp.up_proj.weight",
                      "blk.{i}.ffn_up.weight", n_in=1),
            ParamSpec("layers.w_down", (L, F, E), ("layers", "ffn", "embed"), hf + "mlp.down_proj.weight",
                      "blk.{i}.ffn_down.weight", n_in=1),
        ]
        if self.qkv_bias:
            specs += [
                ParamSpec("layers.bq", (L, H, D), ("layers", "q_heads", "head_dim"), hf + "self_attn.q_proj.bias",
                          "blk.{i}.attn_q.bias", init="zeros"),
                ParamSpec("layers.bk", (L, K, D), ("layers", "kv_heads", "head_dim"), hf + "self_attn.k_proj.bias",
                          "blk.{i}.attn_k.bias", init="zeros"),
                ParamSpec("layers.bv", (L, K, D), ("layers", "kv_heads", "head_dim"), hf + "self_attn.v_proj.bias",
                          "blk.{i}.attn_v.bias", init="zeros"),
            ]
        if self.o_bias:
            specs.append(ParamSpec("layers.bo", (L, E), ("layers", "embed"), hf + "self_attn.o_proj.bias",
                                   "blk.{i}.attn_output.bias", init="zeros"))
        if self.qk_norm:
            specs += [
                ParamSpec("layers.q_norm", (L, D), ("layers", "head_dim"), hf + "self_attn.q_norm.weight",
                          "blk.{i}.attn_q_norm.weight", init="ones"),
                ParamSpec("layers.k_norm", (L, D), ("layers", "head_dim"), hf + "self_attn.k_norm.weight",
                          "blk.{i}.attn_k_norm.weight", init="ones"),
            ]
        if not self.tie_word_embeddings:
            specs.append(ParamSpec("lm_head", (E, V), ("embed", "vocab"), "lm_head.weight", "output.weight", n_in=1))
        return tuple(specs)


def _rope_scaling(rope: Mapping[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope.get("low_freq_factor", 1.0)),
            float(rope.get("high_freq_factor", 4.0)),
            int(rope.get("original_max_position_embeddings", 8192)),
        )
    raise JfireError(f"unsupported rope scaling {kind!r}; jfire supports 'default', 'linear' and 'llama3'")


# -- the forward pass ----------------------------------------------------------------------


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse rotary frequencies [D/2], computed the way transformers does (float32)."""
    D = cfg.head_dim
    inv = (1.0 / (cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / D))).astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return (inv / s.factor).astype(np.float32)
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # Normalise in float32 and scale in the activation dtype, as the reference does.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates halves (not interleaved pairs): the HF layout. x [b, t, h, d]; cos/sin [b, t, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def init_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype, page_size: int = 16) -> dict:
    """A fresh cache for `batch` rows of up to `max_len` positions, each row owning its own
    consecutive pages: the contiguous layout, expressed as pages and a page table."""
    per_row = -(-max_len // page_size)
    shape = (cfg.num_layers, cfg.num_kv_heads, batch * per_row, page_size, cfg.head_dim)
    return {
        "k": jnp.zeros(shape, dtype),
        "v": jnp.zeros(shape, dtype),
        "page_table": jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row),
    }


def forward(params: dict, cfg: LlamaConfig, tokens: jax.Array, positions: jax.Array, cache: dict):
    """Logits [b, t, v] (float32) for every token, and the updated cache (from `init_cache`)."""
    pages = {"k": cache["k"], "v": cache["v"]}
    hidden, pages = decoder(params, cfg, tokens, positions, pages, cache["page_table"])
    return logits_from_hidden(params, cfg, hidden), {**pages, "page_table": cache["page_table"]}


def decoder(params: dict, cfg: LlamaConfig, tokens, positions, pages: dict, page_table, *, attention_impl=None,
            layer_stack=None):
    """Runs tokens [b, t] at `positions` [b, t] against the paged cache; returns (hidden [b, t, e], pages).

    pages: {"k", "v"} [layers, kv_heads, num_pages, page_size, d]; page_table [b, w].
    New keys and values are written into their slots before attention, so the same function
    serves prefill (t = a prompt chunk) and decode (t = 1). Padding tokens carry position -1:
    their writes are dropped. `attention_impl(q, k_pages, v_pages, layer, page_table,
    positions)` replaces the reference attention (the Pallas decode kernel plugs in here).
    `layer_stack` replaces `run_layers` (a pipeline over stages plugs in here).
    """
    x = params["embed"][tokens]  # [b, t, e]
    stack = layer_stack or run_layers
    x, pages = stack(params["layers"], cfg, x, positions, pages, page_table, attention_impl)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), pages


def run_layers(layers: dict, cfg: LlamaConfig, x, positions, pages: dict, page_table, attention_impl=None):
    """The stacked layers `layers` (leading axis: layer) over activations x [b, t, e].

    `pages` holds exactly these layers' cache ({"k", "v"} [len(layers), ...]); layer i of the
    stack reads and writes slice i.
    """
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, t, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    num_pages, page_size = pages["k"].shape[2], pages["k"].shape[3]
    page_table = jnp.asarray(page_table)
    rows = jnp.arange(x.shape[0])[:, None]
    # Padding writes go to page `num_pages` (out of range), which the scatter drops.
    valid = positions >= 0
    write_page = jnp.where(valid, page_table[rows, jnp.where(valid, positions, 0) // page_size], num_pages)
    write_slot = jnp.where(valid, positions, 0) % page_size
    attend = attention_impl or functools.partial(paged_attention_reference, sliding_window=cfg.sliding_window)

    def layer(carry, xs):
        x, k_pages, v_pages = carry
        p, i = xs
        with jax.named_scope("attention"):
            h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            q = jnp.einsum("bte,ehd->bthd", h, p["wq"])
            k = jnp.einsum("bte,ekd->btkd", h, p["wk"])
            v = jnp.einsum("bte,ekd->btkd", h, p["wv"])
            if cfg.qkv_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            if cfg.qk_norm:
                q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            # Indexed [layer, :, page, slot] the update is [b, t, k, d]: k's own layout.
            k_pages = k_pages.at[i, :, write_page, write_slot].set(k.astype(k_pages.dtype), mode="drop")
            v_pages = v_pages.at[i, :, write_page, write_slot].set(v.astype(v_pages.dtype), mode="drop")
            out = attend(q, k_pages, v_pages, i, page_table, positions)
            # One contraction over h*d: XLA CPU otherwise transposes wo on every call.
            b, t, h, d = out.shape
            x = x + jnp.einsum("btf,fe->bte", out.reshape(b, t, h * d), p["wo"].reshape(h * d, -1))
            if cfg.o_bias:
                x = x + p["bo"]
        with jax.named_scope("mlp"):
            h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            gate = jax.nn.silu(jnp.einsum("bte,ef->btf", h, p["w_gate"]))
            up = jnp.einsum("bte,ef->btf", h, p["w_up"])
            x = x + jnp.einsum("btf,fe->bte", gate * up, p["w_down"])
        return (x, k_pages, v_pages), None

    # The whole cache rides in the carry so each layer updates it in place (a scanned-over
    # output would be a second full copy of the pool).
    num_layers = pages["k"].shape[0]
    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    carry = (x, pages["k"], pages["v"])
    if _has_compressed(layers):
        # Weights kept compressed in device memory: each layer is decoded just before it runs.
        from jfire.checkpoint.compressed import decompress_layer

        step = lambda c, i: layer(c, (decompress_layer(layers, i, dtype=x.dtype), i))
        (x, k, v), _ = jax.lax.scan(step, carry, layer_ids)
    else:
        (x, k, v), _ = jax.lax.scan(layer, carry, (layers, layer_ids))
    return x, {"k": k, "v": v}


def _has_compressed(layers: dict) -> bool:
    from jfire.kernels.bf16_decode import Compressed

    return any(isinstance(leaf, Compressed) for leaf in layers.values())


def logits_from_hidden(params: dict, cfg: LlamaConfig, x: jax.Array) -> jax.Array:
    with jax.named_scope("lm_head"):
        if cfg.tie_word_embeddings:
            return jnp.einsum("...e,ve->...v", x, params["embed"], preferred_element_type=jnp.float32)
        return jnp.einsum("...e,ev->...v", x, params["lm_head"], preferred_element_type=jnp.float32)
