"""The Llama family of decoders: Llama 2/3.x, Mistral, Qwen2, Qwen3, SmolLM2, and their
mixture-of-experts forms Mixtral and Qwen3-MoE.

They share one architecture (pre-norm RMSNorm, rotary positions, grouped-query attention,
SwiGLU MLP) and differ only in switches this config carries: q/k/v biases (Qwen2), q/k
norms (Qwen3), Llama-3 rope scaling, a sliding window (Mistral v0.1), tied embeddings, and
routed experts in place of the MLP (Mixtral: softmax over the chosen logits; Qwen3-MoE:
softmax over all experts, optionally renormalised, with some layers kept dense).

Einsum letters:
  b batch, t query tokens, s key/cache slots, e embed, h query heads, k kv heads,
  g query heads per kv head, d head dim, f ffn, v vocab, x experts.

Parameters are stacked over layers (leading `layers` axis) so a run of identical layers is
one `lax.scan`: one compiled layer body, and a single axis for pipeline stages to split.
Where dense layers and layers with experts alternate (Qwen3-MoE's `decoder_sparse_step`), one
period of them is the scanned unit, its params stacked per position of the period.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax

from jfire.errors import JfireError
from jfire.kernels.cpu_attention import paged_attention
from jfire.models.blocks import (
    PreNormFamily,
    RopeScaling,
    apply_rope,
    attention_fn,
    cache_slots,
    gqa_mesh_problems,
    kv_cache_specs,
    layer_matmul,
    layer_matmuls,
    repeat_kv_heads,
    rms_norm,
    rope_angles,
    rope_inv_freq,
    rope_params,
    write_heads,
)
from jfire.models.family import CacheGroup, CacheSpec, LayerStack, MeshShape, scan_segment, segments_of
from jfire.models.params import ParamSpec

# HF `architectures[0]` -> the name GGUF files use for the same family (None: not read from GGUF).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": None,
    "Qwen3MoeForCausalLM": None,
}
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Routers (jfire.models.moe.Router kinds) and where each family keeps its experts on disk.
_MOE = {
    "MixtralForCausalLM": (
        "softmax_topk",
        "block_sparse_moe.gate.weight",
        (
            "block_sparse_moe.experts.{e}.w1.weight",
            "block_sparse_moe.experts.{e}.w3.weight",
            "block_sparse_moe.experts.{e}.w2.weight",
        ),
    ),
    "Qwen3MoeForCausalLM": (
        "softmax",
        "mlp.gate.weight",
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    ),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig(PreNormFamily):
    family: ClassVar[str] = "llama"

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
    # Mixture of experts (num_experts = 0: every layer dense).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    router: str = ""  # a jfire.models.moe.Router kind
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()  # layers that keep the dense MLP in an MoE model

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise JfireError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise JfireError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise JfireError(
                f"num_experts_per_tok ({self.experts_per_token}) must be between 1 and the {self.num_experts} experts"
            )

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """Builds the config from a Hugging Face `config.json` dict (transformers 4.x or 5.x)."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise JfireError(f"unsupported architecture {arch!r} in config.json")
        if hf.get("mlp_bias"):
            raise JfireError("config.json sets mlp_bias=true, which jfire does not support")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise JfireError(f"unsupported hidden_act {act!r}; the Llama family uses 'silu'")
        theta, scaling = rope_params(hf)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        window = hf.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            if hf.get("use_sliding_window"):
                raise JfireError(f"{arch} with use_sliding_window=true is not supported")
            window = None
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        layers = int(hf["num_hidden_layers"])
        moe = {}
        if arch == "MixtralForCausalLM":
            moe = dict(
                num_experts=int(hf["num_local_experts"]),
                experts_per_token=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["intermediate_size"]),
                router="softmax_topk",
            )
        elif arch == "Qwen3MoeForCausalLM":
            step = int(hf.get("decoder_sparse_step", 1) or 1)
            only = set(int(i) for i in hf.get("mlp_only_layers") or ())
            dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
            moe = dict(
                num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
                experts_per_token=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                router="softmax",
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                dense_layers=dense,
            )
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", False)) or arch == "Qwen2ForCausalLM",
            o_bias=bool(hf.get("attention_bias", False)) and arch not in ("Qwen2ForCausalLM",),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=int(window) if window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], has_output_tensor: bool) -> LlamaConfig:
        """Builds the config from GGUF metadata (`general.architecture` and its `ARCH.*` keys)."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise JfireError(
                f"unsupported GGUF architecture {arch!r}; jfire supports " + ", ".join(sorted(GGUF_ARCHITECTURES))
            )
        if meta.get(f"{arch}.expert_count"):
            raise JfireError(
                f"this GGUF file holds a mixture-of-experts model ({arch}.expert_count = "
                f"{meta[f'{arch}.expert_count']}); jfire reads MoE models from HF directories only"
            )

        def key(name, default=None):
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise JfireError(f"GGUF metadata lacks '{arch}.{name}'")
            return value

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        head_dim = int(
            meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // num_heads
        )
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = None
        if meta.get(f"{arch}.rope.scaling.type") == "linear":
            scaling = RopeScaling("linear", float(meta[f"{arch}.rope.scaling.factor"]))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
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

    # -- the declarations ----------------------------------------------------------------------

    def layer_kinds(self) -> list[str]:
        if not self.num_experts:
            return ["dense"] * self.num_layers
        return ["dense" if i in self.dense_layers else "moe" for i in range(self.num_layers)]

    def segments(self):
        return segments_of(self.layer_kinds())

    def param_specs(self) -> tuple[ParamSpec, ...]:
        """Every parameter: shape, logical axes, and where it lives in HF and GGUF files.

        Layer parameters carry a leading `layers` axis; `{i}` in a source name is the layer.
        `n_in` marks a linear layer whose first n_in dims are inputs: HF stores it [out, in].
        """
        E, V = self.hidden_size, self.vocab_size
        specs = [
            ParamSpec(
                "embed", (V, E), ("vocab", "embed"), "model.embed_tokens.weight", "token_embd.weight", flat_source=False
            ),
            ParamSpec("final_norm", (E,), ("embed",), "model.norm.weight", "output_norm.weight", init="ones"),
        ]
        for segment in self.segments():
            for stack in segment.stacks():
                specs += self._layer_specs(stack)
        if not self.tie_word_embeddings:
            specs.append(ParamSpec("lm_head", (E, V), ("embed", "vocab"), "lm_head.weight", "output.weight", n_in=1))
        return tuple(specs)

    def _layer_specs(self, stack: LayerStack) -> list[ParamSpec]:
        L, E, F = stack.count, self.hidden_size, self.intermediate_size
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        hf, s = "model.layers.{i}.", stack.path + "."

        def spec(name, shape, axes, hf_name, gguf, **kw):
            return ParamSpec(
                s + name,
                (L, *shape),
                ("layers", *axes),
                hf + hf_name if hf_name else None,
                gguf,
                first_layer=stack.first,
                layer_step=stack.step,
                **kw,
            )

        specs = [
            spec("attn_norm", (E,), ("embed",), "input_layernorm.weight", "blk.{i}.attn_norm.weight", init="ones"),
            spec(
                "wq",
                (E, H, D),
                ("embed", "q_heads", "head_dim"),
                "self_attn.q_proj.weight",
                "blk.{i}.attn_q.weight",
                n_in=1,
                gguf_rotary_heads=H,
            ),
            spec(
                "wk",
                (E, K, D),
                ("embed", "kv_heads", "head_dim"),
                "self_attn.k_proj.weight",
                "blk.{i}.attn_k.weight",
                n_in=1,
                gguf_rotary_heads=K,
            ),
            spec(
                "wv",
                (E, K, D),
                ("embed", "kv_heads", "head_dim"),
                "self_attn.v_proj.weight",
                "blk.{i}.attn_v.weight",
                n_in=1,
            ),
            spec(
                "wo",
                (H, D, E),
                ("q_heads", "head_dim", "embed"),
                "self_attn.o_proj.weight",
                "blk.{i}.attn_output.weight",
                n_in=2,
            ),
            spec(
                "mlp_norm", (E,), ("embed",), "post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", init="ones"
            ),
        ]
        if stack.kind == "moe":
            X, I = self.num_experts, self.moe_intermediate_size
            _, gate, (w_gate, w_up, w_down) = _MOE[self.architecture]
            specs += [
                spec("router", (E, X), ("embed", "experts_replicated"), gate, None, n_in=1),
                spec("we_gate", (X, E, I), ("experts", "embed", "ffn"), w_gate, None, n_in=1, per_expert=True),
                spec("we_up", (X, E, I), ("experts", "embed", "ffn"), w_up, None, n_in=1, per_expert=True),
                spec("we_down", (X, I, E), ("experts", "ffn", "embed"), w_down, None, n_in=1, per_expert=True),
            ]
        else:
            specs += [
                spec("w_gate", (E, F), ("embed", "ffn"), "mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", n_in=1),
                spec("w_up", (E, F), ("embed", "ffn"), "mlp.up_proj.weight", "blk.{i}.ffn_up.weight", n_in=1),
                spec("w_down", (F, E), ("ffn", "embed"), "mlp.down_proj.weight", "blk.{i}.ffn_down.weight", n_in=1),
            ]
        if self.qkv_bias:
            specs += [
                spec(
                    "bq", (H, D), ("q_heads", "head_dim"), "self_attn.q_proj.bias", "blk.{i}.attn_q.bias", init="zeros"
                ),
                spec(
                    "bk", (K, D), ("kv_heads", "head_dim"), "self_attn.k_proj.bias", "blk.{i}.attn_k.bias", init="zeros"
                ),
                spec(
                    "bv", (K, D), ("kv_heads", "head_dim"), "self_attn.v_proj.bias", "blk.{i}.attn_v.bias", init="zeros"
                ),
            ]
        if self.o_bias:
            specs.append(
                spec("bo", (E,), ("embed",), "self_attn.o_proj.bias", "blk.{i}.attn_output.bias", init="zeros")
            )
        if self.qk_norm:
            specs += [
                spec(
                    "q_norm", (D,), ("head_dim",), "self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", init="ones"
                ),
                spec(
                    "k_norm", (D,), ("head_dim",), "self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", init="ones"
                ),
            ]
        return specs

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        return kv_cache_specs(self.num_layers, self.num_kv_heads, self.head_dim, self.cache_groups()[0].name)

    def cache_groups(self) -> tuple[CacheGroup, ...]:
        # Every layer of a sliding-window model (Mistral v0.1) sees the same window.
        if self.sliding_window:
            return (CacheGroup("sliding", sliding_window=self.sliding_window),)
        return super().cache_groups()

    def mesh_problems(self, shape: MeshShape) -> list[str]:
        problems = super().mesh_problems(shape)
        tp, ep = shape.tp, shape.ep
        problems += gqa_mesh_problems(self.num_heads, self.num_kv_heads, tp)
        if "dense" in self.layer_kinds() and self.intermediate_size % tp:
            problems.append(f"tp={tp} does not divide the MLP width {self.intermediate_size}")
        if self.num_experts:
            if self.num_experts % ep:
                problems.append(f"ep={ep} does not divide the {self.num_experts} experts")
            if self.moe_intermediate_size % tp:
                problems.append(f"tp={tp} does not divide the expert width {self.moe_intermediate_size}")
        elif ep > 1:
            problems.append(f"ep={ep} needs a model with experts; this one has none (use ep=1)")
        return problems

    def adapt_to_tp(self, tp: int):
        return repeat_kv_heads(self, tp)

    # -- the forward pass --------------------------------------------------------------------

    def run_segment(
        self,
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
        """One segment's stacked layers over activations x [b, t, e]; layer j of the segment
        reads and writes cache layer cache_offset + j.

        New keys and values are written into their slots before attention, so the same function
        serves prefill (t = a prompt chunk) and decode (t = 1). Padding tokens carry position -1:
        their writes are dropped. `attention_impl(q, k_pages, v_pages, layer, page_table,
        positions, sliding_window=, chunk=)` replaces the reference attention (the Pallas decode
        kernel plugs in here).
        """
        cos, sin = rope_angles(positions, rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling))
        page, slot = cache_slots(positions, page_table, pages["k"].shape[2], pages["k"].shape[3])
        # On the CPU kernel where it applies, else the reference (or the engine's, `attention_fn`).
        attend = attention_fn(attention_impl, paged_attention)

        def layer(carry, p, j, kind):
            x, k_pages, v_pages = carry
            i = cache_offset + j
            with jax.named_scope("attention"):
                h = rms_norm(x, p["attn_norm"], self.rms_norm_eps)
                q, k, v = layer_matmuls(h, p, ("wq", "wk", "wv"))
                if self.qkv_bias:
                    q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
                if self.qk_norm:
                    q = rms_norm(q, p["q_norm"], self.rms_norm_eps)
                    k = rms_norm(k, p["k_norm"], self.rms_norm_eps)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                k_pages = write_heads(k_pages, i, page, slot, k)
                v_pages = write_heads(v_pages, i, page, slot, v)
                out = attend(q, k_pages, v_pages, i, page_table, positions, sliding_window=self.sliding_window)
                x = x + layer_matmul(out, p, "wo", n_in=2)
                if self.o_bias:
                    x = x + p["bo"]
            h = rms_norm(x, p["mlp_norm"], self.rms_norm_eps)
            if kind == "moe":
                from jfire.models.experts import routed_experts
                from jfire.models.moe import Router

                with jax.named_scope("experts"):
                    x = x + routed_experts(
                        h,
                        p["router"],
                        p["we_gate"],
                        p["we_up"],
                        p["we_down"],
                        router=Router(self.router, self.experts_per_token, self.norm_topk_prob),
                        parallel=parallel,
                    )
            else:
                with jax.named_scope("mlp"):
                    gate, up = layer_matmuls(h, p, ("w_gate", "w_up"))
                    x = x + layer_matmul(jax.nn.silu(gate) * up, p, "w_down")
            return x, k_pages, v_pages

        x, k, v = scan_segment(segment, layer, stack, (x, pages["k"], pages["v"]), x.dtype, in_place=True)
        return x, {**pages, "k": k, "v": v}
