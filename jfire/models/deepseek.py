"""DeepSeek-V3 and Kimi K2 / K2.5 (the text model), as transformers' `modeling_deepseek_v3.py`
computes it.

  - Multi-head latent attention (jfire.models.mla): a low-rank query (`q_a_proj`, its norm,
    `q_b_proj`), keys and values compressed into one normalised latent per token plus one
    shared rope key; the cache holds only those (`kv_lora_rank + qk_rope_head_dim` values
    per token per layer). RoPE on the rope part is interleaved, YaRN-scaled.
  - The first `first_k_dense_replace` layers have a dense MLP, the rest routed experts: a
    float32 sigmoid router whose `e_score_correction_bias` only chooses experts, limited to
    the best `topk_group` of `n_group` groups; the chosen experts' unbiased scores are
    renormalised and scaled by `routed_scaling_factor`; shared experts see every token.
  - Kimi K2.5 nests this under `text_config`, its tensors under `language_model.`, beside a
    vision tower (skipped), and keeps the routed experts int4 (compressed-tensors
    pack-quantized); they stay packed on the device (jfire.kernels.int4_experts).
  - DeepSeek-V3 and Kimi K2 as released store their linears FP8 with 128 x 128 block scales
    (`quant_method: fp8`): the routed experts, nearly all of the weights, stay FP8 on the
    device (jfire.models.fp8_experts); the other linears are dequantized on load.

The dense layers are run outside the pipeline (`piped=False`): they are a handful at the
front (Kimi: 1 of 61), so pipeline stages split the uniform MoE stack alone; the dense
layers' weights and latent cache live on every stage.

Einsum letters: b batch, t tokens, e embed, h heads, c latent, f ffn, x experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from jfire.checkpoint.fp8 import BLOCK as FP8_BLOCK
from jfire.errors import JfireError
from jfire.models import mla
from jfire.models.blocks import PreNormFamily, Yarn
from jfire.models.family import CacheSpec, MeshShape, Segment
from jfire.models.params import ParamSpec

SUPPORTED_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "Kimi_K25ForConditionalGeneration",
)
_MULTIMODAL_PREFIX = "language_model."
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(PreNormFamily):
    family: ClassVar[str] = "deepseek_v3"

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP width
    moe_intermediate_size: int  # each routed expert's width
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    yarn: Yarn | None = None
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_prefix: str = ""  # "language_model." in Kimi K2.5's released layout
    int4_group_size: int | None = None  # routed experts kept int4 (pack-quantized), group size along inputs
    fp8_experts: bool = False  # routed experts kept FP8 e4m3 with 128 x 128 block scales
    extra_layers: int = 0  # multi-token-prediction layers in the checkpoint, which jfire does not run

    def __post_init__(self):
        if self.num_experts and self.num_experts % self.n_group:
            raise JfireError(f"n_group ({self.n_group}) must divide n_routed_experts ({self.num_experts})")
        if not 1 <= self.topk_group <= self.n_group:
            raise JfireError(f"topk_group ({self.topk_group}) must be between 1 and n_group ({self.n_group})")
        if self.int4_group_size and self.fp8_experts:
            raise JfireError("routed experts are either int4 (pack-quantized) or FP8, not both")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> DeepseekV3Config:
        arch = (hf.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
        prefix = ""
        quant = hf.get("quantization_config")
        if "text_config" in hf:
            if not isinstance(hf.get("text_config"), dict):
                raise JfireError(f"a {arch} config.json needs its 'text_config'")
            outer, hf, prefix = hf, hf["text_config"], _MULTIMODAL_PREFIX
            quant = quant or hf.get("quantization_config")
            hf = {**{k: outer[k] for k in ("eos_token_id", "bos_token_id") if k in outer}, **hf}
        if hf.get("attention_bias"):
            raise JfireError("config.json sets attention_bias=true, which jfire's DeepSeek-V3 does not support")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise JfireError(f"unsupported hidden_act {act!r}; DeepSeek-V3 uses 'silu'")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise JfireError(
                "jfire's DeepSeek-V3 routes with scoring_func 'sigmoid' and topk_method 'noaux_tc' "
                f"(this config has {hf.get('scoring_func')!r}, {hf.get('topk_method')!r})"
            )
        rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        kind = rope.get("rope_type", rope.get("type", "default"))
        max_pos = int(hf.get("max_position_embeddings", 4096))
        if kind not in (None, "default", "yarn"):
            raise JfireError(f"unsupported rope scaling {kind!r} for DeepSeek-V3; jfire supports 'default' and 'yarn'")
        eos = hf.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=int(hf["num_attention_heads"]),
            q_lora_rank=int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None,
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            max_position_embeddings=max_pos,
            num_experts=int(hf["n_routed_experts"]),
            experts_per_token=int(hf["num_experts_per_tok"]),
            num_shared_experts=int(hf.get("n_shared_experts") or 0),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            first_k_dense_replace=int(hf.get("first_k_dense_replace", 0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            yarn=Yarn.from_hf(rope, max_pos) if kind == "yarn" else None,
            rope_interleave=bool(hf.get("rope_interleave", True)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            hf_prefix=prefix,
            int4_group_size=_int4_group_size(quant),
            fp8_experts=_is_block_fp8(quant),
            extra_layers=int(hf.get("num_nextn_predict_layers") or 0),
        )

    @classmethod
    def from_gguf(cls, meta, has_output_tensor):
        raise JfireError("jfire reads DeepSeek-V3 and Kimi from Hugging Face directories, not GGUF files")

    def skipped_source_prefixes(self) -> tuple[str, ...]:
        mtp = tuple(f"{self.hf_prefix}model.layers.{self.num_layers + i}." for i in range(self.extra_layers))
        return (_VISION_PREFIXES if self.hf_prefix else ()) + mtp

    # -- declarations --------------------------------------------------------------------------

    @property
    def dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_layers)

    def segments(self):
        dense, moe = self.dense_layers, self.num_layers - self.dense_layers
        out = []
        if dense:
            out.append(Segment("dense_layers", 0, dense, "dense", piped=False, cache_offset=0))
        if moe:
            out.append(Segment("layers", dense, moe, "moe", cache_offset=0))
        return tuple(out)

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """One latent array per segment: [layers, pages, page_slots, latent + rope]. The dense
        layers' array is not split over pipeline stages; the pages of both are split over the
        devices of a stage (sequence-sharded, `latent_pages`), so each token's latent is stored
        once per stage."""
        specs = []
        for s in self.segments():
            layers = "layers" if s.piped else "layers_unpiped"
            specs.append(
                CacheSpec(
                    "latent" if s.piped else "latent_dense",
                    (layers, "latent_pages", "page_slots", "latent"),
                    (s.count, None, None, self.latent_width),
                )
            )
        return tuple(specs)

    def param_specs(self) -> tuple[ParamSpec, ...]:
        E, V, pre = self.hidden_size, self.vocab_size, self.hf_prefix
        specs = [
            ParamSpec("embed", (V, E), ("vocab", "embed"), pre + "model.embed_tokens.weight", None, flat_source=False),
            ParamSpec("final_norm", (E,), ("embed",), pre + "model.norm.weight", None, init="ones"),
        ]
        for segment in self.segments():
            specs += self._layer_specs(segment)
        if not self.tie_word_embeddings:
            specs.append(ParamSpec("lm_head", (E, V), ("embed", "vocab"), pre + "lm_head.weight", None, n_in=1))
        return tuple(specs)

    def _layer_specs(self, segment: Segment) -> list[ParamSpec]:
        L, E, H = segment.count, self.hidden_size, self.num_heads
        C, R, Dn, Dv = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
        hf, s = self.hf_prefix + "model.layers.{i}.", segment.name + "."
        layers = "layers" if segment.piped else "layers_unpiped"

        def spec(name, shape, axes, hf_name, **kw):
            return ParamSpec(
                s + name, (L, *shape), (layers, *axes), hf + hf_name, None, first_layer=segment.first, **kw
            )

        specs = [spec("attn_norm", (E,), ("embed",), "input_layernorm.weight", init="ones")]
        if self.q_lora_rank:
            Q = self.q_lora_rank
            specs += [
                # The low-rank query is split over tp (its norm reduces across the shards), then
                # gathered for q_b, whose heads are split.
                spec("wq_a", (E, Q), ("embed", "q_lora"), "self_attn.q_a_proj.weight", n_in=1),
                spec("q_a_norm", (Q,), ("q_lora",), "self_attn.q_a_layernorm.weight", init="ones"),
                spec(
                    "wq_b",
                    (Q, H, Dn + R),
                    ("q_lora_in", "q_heads", "mla_head_dim"),
                    "self_attn.q_b_proj.weight",
                    n_in=1,
                ),
            ]
        else:
            specs.append(
                spec("wq", (E, H, Dn + R), ("embed", "q_heads", "mla_head_dim"), "self_attn.q_proj.weight", n_in=1)
            )
        specs += [
            # Split over its input (one all-reduce of the small latent): every device needs the whole latent.
            spec("wkv_a", (E, C + R), ("embed_split", "latent"), "self_attn.kv_a_proj_with_mqa.weight", n_in=1),
            spec("kv_a_norm", (C,), ("latent",), "self_attn.kv_a_layernorm.weight", init="ones"),
            spec("wkv_b", (C, H, Dn + Dv), ("latent", "q_heads", "mla_head_dim"), "self_attn.kv_b_proj.weight", n_in=1),
            spec("wo", (H, Dv, E), ("q_heads", "head_dim", "embed"), "self_attn.o_proj.weight", n_in=2),
            spec("mlp_norm", (E,), ("embed",), "post_attention_layernorm.weight", init="ones"),
        ]
        if segment.kind == "dense":
            F = self.intermediate_size
            return specs + [
                spec("w_gate", (E, F), ("embed", "ffn"), "mlp.gate_proj.weight", n_in=1),
                spec("w_up", (E, F), ("embed", "ffn"), "mlp.up_proj.weight", n_in=1),
                spec("w_down", (F, E), ("ffn", "embed"), "mlp.down_proj.weight", n_in=1),
            ]
        X, F = self.num_experts, self.moe_intermediate_size
        specs += [
            spec("router", (E, X), ("embed_split", "experts_replicated"), "mlp.gate.weight", n_in=1),
            # Added to the scores only to choose experts; float32 as transformers keeps it.
            spec(
                "router_bias",
                (X,),
                ("experts_replicated",),
                "mlp.gate.e_score_correction_bias",
                init="zeros",
                dtype="float32",
            ),
        ]
        specs += self._expert_specs(spec, X, E, F)
        if self.num_shared_experts:
            Fs = F * self.num_shared_experts
            specs += [
                spec("ws_gate", (E, Fs), ("embed", "ffn"), "mlp.shared_experts.gate_proj.weight", n_in=1),
                spec("ws_up", (E, Fs), ("embed", "ffn"), "mlp.shared_experts.up_proj.weight", n_in=1),
                spec("ws_down", (Fs, E), ("ffn", "embed"), "mlp.shared_experts.down_proj.weight", n_in=1),
            ]
        return specs

    def _expert_specs(self, spec, X: int, E: int, F: int) -> list[ParamSpec]:
        name = "mlp.experts.{e}.%s_proj.%s"
        if not (self.int4_group_size or self.fp8_experts):
            return [
                spec(
                    "we_gate",
                    (X, E, F),
                    ("experts", "embed", "ffn"),
                    name % ("gate", "weight"),
                    n_in=1,
                    per_expert=True,
                ),
                spec("we_up", (X, E, F), ("experts", "embed", "ffn"), name % ("up", "weight"), n_in=1, per_expert=True),
                spec(
                    "we_down",
                    (X, F, E),
                    ("experts", "ffn", "embed"),
                    name % ("down", "weight"),
                    n_in=1,
                    per_expert=True,
                ),
            ]
        # Quantized, kept in the source's [out, in] layout beside its scales.
        raw = dict(per_expert=True, flat_source=False)
        out = []
        for proj, (o, i), axes in (
            ("gate", (F, E), ("ffn", "embed")),
            ("up", (F, E), ("ffn", "embed")),
            ("down", (E, F), ("embed", "ffn")),
        ):
            if self.fp8_experts:
                blocks = (-(-o // FP8_BLOCK), -(-i // FP8_BLOCK))
                out += [
                    spec(
                        f"we_{proj}.fp8",
                        (X, o, i),
                        ("experts", *axes),
                        name % (proj, "weight"),
                        init="fp8",
                        dtype="float8_e4m3fn",
                        **raw,
                    ),
                    spec(
                        f"we_{proj}.scale_inv",
                        (X, *blocks),
                        ("experts", axes[0] + "_blocks", axes[1] + "_blocks"),
                        name % (proj, "weight_scale_inv"),
                        init="fp8_scale",
                        dtype="float32",
                        **raw,
                    ),
                ]
                continue
            # Packed int4: [out, in / 8] words with [out, in / group] scales.
            G = self.int4_group_size
            out += [
                spec(
                    f"we_{proj}.packed",
                    (X, o, i // 8),
                    ("experts", axes[0], axes[1] + "_packed"),
                    name % (proj, "weight_packed"),
                    init="int4",
                    dtype="int32",
                    **raw,
                ),
                spec(
                    f"we_{proj}.scale",
                    (X, o, i // G),
                    ("experts", axes[0], axes[1] + "_groups"),
                    name % (proj, "weight_scale"),
                    init="int4_scale",
                    **raw,
                ),
            ]
        return out

    def mesh_problems(self, shape: MeshShape) -> list[str]:
        problems = super().mesh_problems(shape)
        tp, ep = shape.tp, shape.ep
        if self.num_heads % tp:
            problems.append(f"tp={tp} does not divide the {self.num_heads} attention heads")
        widths = [("dense MLP width", self.intermediate_size)] if self.dense_layers else []
        widths += [("expert width", self.moe_intermediate_size)]
        if self.num_shared_experts:
            widths.append(("shared expert width", self.moe_intermediate_size * self.num_shared_experts))
        for what, width in widths:
            if width % tp:
                problems.append(f"tp={tp} does not divide the {what} {width}")
        if self.int4_group_size and (self.moe_intermediate_size // self.int4_group_size) % tp:
            problems.append(
                f"tp={tp} does not divide the expert width's {self.moe_intermediate_size // self.int4_group_size} "
                f"int4 groups of {self.int4_group_size}"
            )
        if self.fp8_experts and tp > 1 and (self.moe_intermediate_size // tp) % FP8_BLOCK:
            problems.append(
                f"tp={tp} does not split the expert width {self.moe_intermediate_size} into whole "
                f"FP8 scale blocks of {FP8_BLOCK} (each shard needs a multiple of {FP8_BLOCK})"
            )
        if self.num_experts % ep:
            problems.append(f"ep={ep} does not divide the {self.num_experts} experts")
        return problems

    # -- the forward pass ----------------------------------------------------------------------

    # The layer (multi-head latent attention, dense or routed MLP) is jfire.models.mla's.
    run_segment = mla.run_segment


def _int4_group_size(quant: Mapping[str, Any] | None) -> int | None:
    """The group size of compressed-tensors pack-quantized int4 weights, None when the
    checkpoint is not quantized that way. jfire reads the routed experts as the quantized
    modules (Kimi K2.5's layout)."""
    if not quant or quant.get("quant_method") != "compressed-tensors":
        return None
    if quant.get("format") != "pack-quantized":
        raise JfireError(
            f"compressed-tensors format {quant.get('format')!r} is not supported; jfire reads "
            "'pack-quantized' int4 experts"
        )
    sizes = set()
    for name, group in (quant.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if (
            w.get("num_bits") != 4
            or w.get("type", "int") != "int"
            or not w.get("symmetric", True)
            or w.get("strategy") != "group"
        ):
            raise JfireError(f"quantization group {name!r} is {w}; jfire reads symmetric int4 weights in groups")
        sizes.add(int(w["group_size"]))
    if len(sizes) != 1:
        raise JfireError(f"pack-quantized groups of sizes {sorted(sizes)}; jfire reads one group size")
    size = sizes.pop()
    if size % 8:
        raise JfireError(f"int4 group size {size} is not a multiple of the 8 values an int32 packs")
    return size


def _is_block_fp8(quant: Mapping[str, Any] | None) -> bool:
    """Whether the checkpoint stores its linears as DeepSeek releases them: float8 e4m3 with
    128 x 128 block scales (`weight_scale_inv`). Those routed experts stay FP8 on the device."""
    if not quant or quant.get("quant_method") != "fp8":
        return False
    fmt, block = quant.get("fmt", "e4m3"), list(quant.get("weight_block_size") or [])
    if fmt != "e4m3" or block != [FP8_BLOCK, FP8_BLOCK]:
        raise JfireError(
            f"FP8 quantization with fmt {fmt!r} and weight_block_size {block or None} is not supported; "
            f"jfire reads e4m3 weights in {FP8_BLOCK} x {FP8_BLOCK} blocks, as DeepSeek-V3 and Kimi K2 ship"
        )
    return True
