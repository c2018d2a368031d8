"""Llama 4 (the text model of Scout and Maverick), as transformers' `modeling_llama4.py`
computes it.

Differences from the Llama family:
  - RoPE on three of every four layers (`no_rope_layers`), applied to adjacent pairs
    (interleaved, as complex numbers); llama3 frequency scaling.
  - On RoPE layers: a weightless L2 norm of q and k after RoPE (`use_qk_norm`) and chunked
    local attention (a token sees only earlier tokens of its own `attention_chunk_size`
    chunk). NoPE layers attend globally, with attention temperature tuning: q scaled by
    1 + attn_scale * log1p(floor((position + 1) / floor_scale)).
  - Mixture-of-experts layers every `interleave_moe_layer_step` layers: a top-k router whose
    sigmoid score scales each chosen expert's INPUT, plus a shared expert for every token;
    the other layers have a dense MLP of width `intermediate_size_mlp`.
The cache has one group per kind of attention (`cache_groups`): the NoPE layers' keys and
values (`k`, `v`, over every position) and the chunked layers' (`k_chunked`, `v_chunked`,
whose pages before a query's own chunk go back to their pool), each array holding only its
group's layers. Which group a layer is in (RoPE or not) is scanned data like its other
switches: a layer writes its keys and values into both groups' arrays at its index in its own
group and past the end of the other's (a write there is dropped), and attends through a
`lax.cond` between the two groups. So Scout stays one uniform stack of 48 layers, its scan
step one layer's weights (a period of four unrolled would hold four layers' weights at once).
Where MoE and dense layers alternate (Maverick), one period of them (dense, moe) is the
scanned unit: its layers are unrolled in the scan step, their params stacked per position.

Einsum letters: b batch, t query tokens, e embed, h query heads, k kv heads, d head dim,
f ffn, v vocab, x experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jfire.errors import JfireError
from jfire.kernels.paged_attention import paged_attention_reference
from jfire.models.blocks import (
    PreNormFamily,
    RopeScaling,
    apply_rope_interleaved,
    attention_fn,
    cache_slots,
    gated_mlp,
    gqa_mesh_problems,
    kv_cache_specs,
    out_projection,
    repeat_kv_heads,
    rms_norm,
    rope_angles,
    rope_inv_freq,
    rope_params,
    write_heads,
)
from jfire.models.family import (
    CacheGroup,
    CacheSpec,
    LayerStack,
    MeshShape,
    group_table,
    scan_segment,
    segments_of,
)
from jfire.models.params import ParamSpec

# Both layouts serve the same text model; the multimodal one nests it under `language_model.`.
SUPPORTED_ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
_MULTIMODAL_PREFIX = "language_model."
_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")


@dataclasses.dataclass(frozen=True)
class Llama4Config(PreNormFamily):
    family: ClassVar[str] = "llama4"

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each routed expert's and the shared expert's width
    intermediate_size_mlp: int  # the dense layers' MLP width
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    num_experts: int
    experts_per_token: int
    moe_layers: tuple[int, ...]
    rope_layers: tuple[int, ...]  # layers that apply RoPE (the others are NoPE)
    attention_chunk_size: int | None
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_prefix: str = ""  # "language_model." in the released multimodal layout

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise JfireError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Llama4Config:
        arch = (hf.get("architectures") or [None])[0]
        prefix = ""
        if arch == "Llama4ForConditionalGeneration" or "text_config" in hf:
            if not isinstance(hf.get("text_config"), dict):
                raise JfireError("a Llama4ForConditionalGeneration config.json needs its 'text_config'")
            outer, hf, prefix = hf, hf["text_config"], _MULTIMODAL_PREFIX
            hf = {**{k: outer[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if k in outer}, **hf}
        if hf.get("attention_bias"):
            raise JfireError("config.json sets attention_bias=true, which jfire's Llama 4 does not support")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise JfireError(f"unsupported hidden_act {act!r}; Llama 4 uses 'silu'")
        layers = int(hf["num_hidden_layers"])
        # As Llama4TextConfig derives them: no_rope_layers[i] = 1 means layer i USES RoPE.
        interval = int(hf.get("no_rope_layer_interval", 4))
        use_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        step = int(hf.get("interleave_moe_layer_step", 1))
        moe = hf.get("moe_layers")
        moe = list(range(step - 1, layers, step)) if moe is None else moe
        theta, scaling = rope_params(hf)
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        eos = hf.get("eos_token_id")
        chunk = hf.get("attention_chunk_size")
        return cls(
            architecture=arch or "Llama4ForCausalLM",
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            intermediate_size_mlp=int(hf.get("intermediate_size_mlp", hf["intermediate_size"])),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or 128),  # as Llama4TextConfig defaults it
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            num_experts=int(hf.get("num_local_experts", 16)),
            experts_per_token=int(hf.get("num_experts_per_tok", 1)),
            moe_layers=tuple(int(i) for i in moe),
            rope_layers=tuple(i for i in range(layers) if use_rope[i]),
            attention_chunk_size=int(chunk) if chunk else None,
            use_qk_norm=bool(hf.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
            floor_scale=float(hf.get("floor_scale", 8192)),
            attn_scale=float(hf.get("attn_scale", 0.1)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            hf_prefix=prefix,
        )

    @classmethod
    def from_gguf(cls, meta, has_output_tensor):
        raise JfireError("jfire reads Llama 4 from Hugging Face directories, not GGUF files")

    def skipped_source_prefixes(self) -> tuple[str, ...]:
        return _VISION_PREFIXES if self.hf_prefix else ()

    # -- declarations --------------------------------------------------------------------------

    def segments(self):
        return segments_of(["moe" if i in self.moe_layers else "dense" for i in range(self.num_layers)])

    def param_specs(self) -> tuple[ParamSpec, ...]:
        E, V, pre = self.hidden_size, self.vocab_size, self.hf_prefix
        specs = [
            ParamSpec("embed", (V, E), ("vocab", "embed"), pre + "model.embed_tokens.weight", None, flat_source=False),
            ParamSpec("final_norm", (E,), ("embed",), pre + "model.norm.weight", None, init="ones"),
        ]
        for segment in self.segments():
            for stack in segment.stacks():
                specs += self._layer_specs(stack)
        if not self.tie_word_embeddings:
            specs.append(ParamSpec("lm_head", (E, V), ("embed", "vocab"), pre + "lm_head.weight", None, n_in=1))
        return tuple(specs)

    def _layer_specs(self, stack: LayerStack) -> list[ParamSpec]:
        L, E, H, K, D = stack.count, self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        hf, s = self.hf_prefix + "model.layers.{i}.", stack.path + "."

        def spec(name, shape, axes, hf_name, **kw):
            return ParamSpec(
                s + name,
                (L, *shape),
                ("layers", *axes),
                hf + hf_name,
                None,
                first_layer=stack.first,
                layer_step=stack.step,
                **kw,
            )

        specs = [
            spec("attn_norm", (E,), ("embed",), "input_layernorm.weight", init="ones"),
            spec("wq", (E, H, D), ("embed", "q_heads", "head_dim"), "self_attn.q_proj.weight", n_in=1),
            spec("wk", (E, K, D), ("embed", "kv_heads", "head_dim"), "self_attn.k_proj.weight", n_in=1),
            spec("wv", (E, K, D), ("embed", "kv_heads", "head_dim"), "self_attn.v_proj.weight", n_in=1),
            spec("wo", (H, D, E), ("q_heads", "head_dim", "embed"), "self_attn.o_proj.weight", n_in=2),
            spec("mlp_norm", (E,), ("embed",), "post_attention_layernorm.weight", init="ones"),
        ]
        if stack.kind == "moe":
            X, F = self.num_experts, self.intermediate_size
            # gate_up_proj is fused [x, e, 2f], inputs first: gate is the first half.
            fused = dict(flat_source=False, source_full=2 * F)
            specs += [
                spec("router", (E, X), ("embed", "experts_replicated"), "feed_forward.router.weight", n_in=1),
                spec(
                    "we_gate",
                    (X, E, F),
                    ("experts", "embed", "ffn"),
                    "feed_forward.experts.gate_up_proj",
                    take=(0, F),
                    **fused,
                ),
                spec(
                    "we_up",
                    (X, E, F),
                    ("experts", "embed", "ffn"),
                    "feed_forward.experts.gate_up_proj",
                    take=(F, 2 * F),
                    **fused,
                ),
                spec(
                    "we_down",
                    (X, F, E),
                    ("experts", "ffn", "embed"),
                    "feed_forward.experts.down_proj",
                    flat_source=False,
                ),
                spec("ws_gate", (E, F), ("embed", "ffn"), "feed_forward.shared_expert.gate_proj.weight", n_in=1),
                spec("ws_up", (E, F), ("embed", "ffn"), "feed_forward.shared_expert.up_proj.weight", n_in=1),
                spec("ws_down", (F, E), ("ffn", "embed"), "feed_forward.shared_expert.down_proj.weight", n_in=1),
            ]
        else:
            F = self.intermediate_size_mlp
            specs += [
                spec("w_gate", (E, F), ("embed", "ffn"), "feed_forward.gate_proj.weight", n_in=1),
                spec("w_up", (E, F), ("embed", "ffn"), "feed_forward.up_proj.weight", n_in=1),
                spec("w_down", (F, E), ("ffn", "embed"), "feed_forward.down_proj.weight", n_in=1),
            ]
        return specs

    def cache_groups(self) -> tuple[CacheGroup, ...]:
        """The NoPE layers attend every earlier position ("global"), the RoPE layers their own
        chunk ("chunked"); one group where the model has only one of them, or no chunk size."""
        if not (self.attention_chunk_size and self.rope_layers):
            return super().cache_groups()
        chunked = CacheGroup("chunked", chunk=self.attention_chunk_size)
        return (CacheGroup("global"), chunked) if len(self.rope_layers) < self.num_layers else (chunked,)

    def layer_group(self, i: int) -> CacheGroup:
        """The cache group of model layer i."""
        groups = {g.name: g for g in self.cache_groups()}
        if len(groups) == 1:
            return next(iter(groups.values()))
        return groups["chunked" if i in self.rope_layers else "global"]

    def cache_names(self, group: str) -> tuple[str, str]:
        """The (keys, values) cache arrays of a group: `k`/`v` for the global (or only) group."""
        return ("k_chunked", "v_chunked") if len(self.cache_groups()) > 1 and group == "chunked" else ("k", "v")

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        specs: tuple[CacheSpec, ...] = ()
        for g in self.cache_groups():
            layers = sum(self.layer_group(i) == g for i in range(self.num_layers))
            suffix = self.cache_names(g.name)[0].removeprefix("k")
            specs += kv_cache_specs(layers, self.num_kv_heads, self.head_dim, group=g.name, suffix=suffix)
        return specs

    def group_layers_before(self) -> dict[str, np.ndarray]:
        """Per cache group, [num_layers + 1]: how many of its layers come before model layer L,
        which is layer L's index in its group's arrays (when L is in the group)."""
        out = {}
        for g in self.cache_groups():
            member = [self.layer_group(i) == g for i in range(self.num_layers)]
            out[g.name] = np.concatenate([[0], np.cumsum(member)]).astype(np.int32)
        return out

    def mesh_problems(self, shape: MeshShape) -> list[str]:
        problems = super().mesh_problems(shape)
        tp, ep = shape.tp, shape.ep
        problems += gqa_mesh_problems(self.num_heads, self.num_kv_heads, tp)
        for what, width in (("expert width", self.intermediate_size), ("dense MLP width", self.intermediate_size_mlp)):
            if width % tp:
                problems.append(f"tp={tp} does not divide the {what} {width}")
        if self.num_experts % ep:
            problems.append(f"ep={ep} does not divide the {self.num_experts} experts")
        return problems

    def adapt_to_tp(self, tp: int):
        return repeat_kv_heads(self, tp)

    def layer_data(self) -> dict[str, np.ndarray]:
        """Per-layer switches by model layer: RoPE or not (scanned data; with two cache groups
        it is also the layer's group) and each layer's chunk (0: none; read by
        jfire.throughput, the forward pass takes it from the layer's group)."""
        rope = np.array([i in self.rope_layers for i in range(self.num_layers)])
        chunk = np.where(rope, self.attention_chunk_size or 0, 0).astype(np.int32)
        return {"rope": rope, "chunk": chunk}

    # -- the forward pass ----------------------------------------------------------------------

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
        """One segment's stacked layers over x [b, t, e]; see `LlamaConfig.run_segment`.

        Each layer reads and writes its cache group's arrays through that group's columns of
        the page table. The given arrays start at model layer `layer_offset - cache_offset`
        (layer 0 for the whole model, a stage's first layer for a pipeline stage's slice);
        model layer L sits in its group's arrays at the number of that group's layers from
        there to L."""
        cos, sin = rope_angles(positions, rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling))
        attend = attention_fn(attention_impl, paged_attention_reference)
        groups = {g.name: g for g in self.cache_groups()}
        tables, slots = {}, {}
        for name in groups:
            keys = pages[self.cache_names(name)[0]]
            tables[name] = group_table(self, page_table, name)
            slots[name] = cache_slots(positions, tables[name], keys.shape[2], keys.shape[3])
        before = {name: jnp.asarray(v) for name, v in self.group_layers_before().items()}
        base = layer_offset - cache_offset  # the model layer of the given arrays' layer 0
        # RoPE or not (and so the layer's group): static where all layers are alike, else scanned.
        rope_data = jnp.asarray(self.layer_data()["rope"])
        alike = {True: len(self.rope_layers) == self.num_layers, False: not self.rope_layers}
        # Temperature tuning for NoPE layers, per absolute position [b, t, 1, 1].
        temperature = 1.0 + self.attn_scale * jnp.log1p(
            jnp.floor((positions.astype(jnp.float32) + 1.0) / self.floor_scale)
        )
        temperature = temperature[:, :, None, None]

        def roped(q, k):
            q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
            if self.use_qk_norm:
                q, k = rms_norm(q, None, self.rms_norm_eps), rms_norm(k, None, self.rms_norm_eps)
            return q, k

        def noped(q, k):
            return ((q * temperature).astype(q.dtype) if self.attn_temperature_tuning else q), k

        def layer(carry, p, j, kind):
            x, arrays = carry
            layer_id = layer_offset + j
            with jax.named_scope("attention"):
                h = rms_norm(x, p["attn_norm"], self.rms_norm_eps)
                q = jnp.einsum("bte,ehd->bthd", h, p["wq"])
                k = jnp.einsum("bte,ekd->btkd", h, p["wk"])
                v = jnp.einsum("bte,ekd->btkd", h, p["wv"])
                rope = next((static for static, every in alike.items() if every), None)
                if rope is None:
                    rope = rope_data[layer_id]
                    (q_rope, k_rope), (q_nope, k_nope) = roped(q, k), noped(q, k)
                    q, k = jnp.where(rope, q_rope, q_nope), jnp.where(rope, k_rope, k_nope)
                else:
                    q, k = (roped if rope else noped)(q, k)
                # The layer's index in each group's arrays; past the end where it is not a member.
                index = {}
                for name, group in groups.items():
                    k_name, v_name = self.cache_names(name)
                    i = before[name][layer_id] - before[name][base]
                    if len(groups) > 1:
                        member = rope if group.chunk is not None else ~rope
                        i = jnp.where(member, i, arrays[k_name].shape[0])
                    page, slot = slots[name]
                    arrays = {
                        **arrays,
                        k_name: write_heads(arrays[k_name], i, page, slot, k),
                        v_name: write_heads(arrays[v_name], i, page, slot, v),
                    }
                    index[name] = i

                def attend_in(name):
                    k_name, v_name = self.cache_names(name)
                    chunk = groups[name].chunk
                    return lambda: attend(
                        q, arrays[k_name], arrays[v_name], index[name], tables[name], positions, chunk=chunk
                    )

                if len(groups) > 1:
                    out = jax.lax.cond(rope, attend_in("chunked"), attend_in("global"))
                else:
                    out = attend_in(next(iter(groups)))()
                x = x + out_projection(out, p["wo"])
            h = rms_norm(x, p["mlp_norm"], self.rms_norm_eps)
            if kind == "moe":
                from jfire.models.experts import routed_experts
                from jfire.models.moe import Router

                with jax.named_scope("experts"):
                    routed = routed_experts(
                        h,
                        p["router"],
                        p["we_gate"],
                        p["we_up"],
                        p["we_down"],
                        router=Router("sigmoid_input", self.experts_per_token),
                        parallel=parallel,
                    )
                    x = x + gated_mlp(h, p["ws_gate"], p["ws_up"], p["ws_down"]) + routed
            else:
                with jax.named_scope("mlp"):
                    x = x + gated_mlp(h, p["w_gate"], p["w_up"], p["w_down"])
            return x, arrays

        names = [n for g in groups for n in self.cache_names(g)]
        x, arrays = scan_segment(segment, layer, stack, (x, {n: pages[n] for n in names}), x.dtype)
        return x, {**pages, **arrays}
