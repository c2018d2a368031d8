"""Tiny random models of every supported family, built and saved with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Wider than the default 0.02 so logits are peaked: greedy choices are then decided by
    # clear margins, not float noise.
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    # Llama 2: plain rope, untied embeddings.
    "llama2": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0)),
    # Llama with attention_bias: biases on q/k/v and on the output projection.
    "llama_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(attention_bias=True)),
    # Llama 3.x: llama3 rope scaling; a short original context exercises all three bands.
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )),
    # Mistral v0.1: a sliding window shorter than the test sequences.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=8)),
    # Qwen2: q/k/v biases.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    # Qwen3: q/k norms, head_dim not equal to hidden / heads.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
    # SmolLM2: a Llama with tied embeddings and a large rope theta.
    "smollm2": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        tie_word_embeddings=True, rope_theta=100000.0, num_key_value_heads=1)),
}

# The text model of the tiny Llama 4: 4 layers, so that within a ~30-token test sequence
#   layer 0: NoPE (global, temperature-tuned), dense MLP (intermediate_size_mlp)
#   layer 1: RoPE + qk norm, chunked (8), MoE (intermediate_size, shared expert)
#   layer 2: RoPE + qk norm, chunked (8), dense MLP
#   layer 3: NoPE (global, temperature-tuned), MoE
# Temperature tuning: q *= 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)), so > 1 from
# position 3. llama3 rope bands with head_dim 32, theta 5e5 and original context 64: pair 0
# keeps its frequency, pairs 1-2 are smoothed, the rest divided by the factor.
LLAMA4_TEXT = dict(
    num_hidden_layers=4,
    head_dim=32,
    intermediate_size=96,
    intermediate_size_mlp=160,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    no_rope_layers=[0, 1, 1, 0],
    attention_chunk_size=8,
    attn_temperature_tuning=True,
    floor_scale=4,
    attn_scale=0.25,
    use_qk_norm=True,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 8.0, "original_max_position_embeddings": 64},
)

# MoE families. Kept out of FAMILIES, which the dense parity tests run over; build and save
# them with the same functions. Routers and experts are drawn with initializer_range like the
# other weights, so routing margins are wide.
MOE_FAMILIES = {
    # Mixtral: 4 experts, top-2, softmax over all experts then renormalised over the chosen two.
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0)),
    # Qwen3-MoE: every layer sparse, expert width unlike the (unused here) dense width,
    # q/k norms, head_dim not equal to hidden / heads, top-k renormalised.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=48,
        head_dim=32, tie_word_embeddings=False)),
    # Qwen3-MoE with decoder_sparse_step 2: layers 0 and 2 dense (intermediate_size), 1 and 3
    # sparse (moe_intermediate_size); top-k weights not renormalised.
    "qwen3_moe_sparse": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        num_hidden_layers=4, decoder_sparse_step=2, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, moe_intermediate_size=48, head_dim=32, tie_word_embeddings=False)),
    # Llama 4 text-only (Llama4ForCausalLM, model_type llama4_text): see LLAMA4_TEXT.
    "llama4": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM, LLAMA4_TEXT),
    # Llama 4 as released (Llama4ForConditionalGeneration, model_type llama4): the same text model
    # under language_model.*, a 1-layer vision tower and the projector. COMMON goes into text_config.
    "llama4_mm": (transformers.Llama4Config, transformers.Llama4ForConditionalGeneration, dict(
        text_config=LLAMA4_TEXT,
        vision_config=dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
            image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
            projector_output_dim=32, pixel_shuffle_ratio=0.5, initializer_range=0.2),
        image_token_index=250, boi_token_index=251, eoi_token_index=252,
    )),
}

# Multi-head latent attention families (DeepSeek-V3's modeling code). KV heads equal the heads:
# transformers' eager MLA expands per-head keys and would repeat them otherwise.
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, n_shared_experts=1, tie_word_embeddings=False)
MLA_FAMILIES = {
    # DeepSeek-V3: 8 experts in 4 groups (the best 2 groups chosen), top-2, two dense layers,
    # YaRN with an mscale_all_dim that changes the softmax scale and the cos/sin factor, a
    # non-zero random e_score_correction_bias (build_tiny_hf_model).
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        _MLA, num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 0.7})),
    # Kimi K2 shaped: one group, one dense layer, scaled routing, YaRN with mscale = mscale_all_dim.
    "kimi_k2": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        _MLA, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_group=1, topk_group=1,
        num_experts_per_tok=4, routed_scaling_factor=2.827, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
}

ALL_FAMILIES = {**FAMILIES, **MOE_FAMILIES, **MLA_FAMILIES}


def tiny_hf_config(family: str):
    config_cls, _, extra = ALL_FAMILIES[family]
    if "text_config" in extra:
        # A composite (multimodal) config: COMMON describes its language model.
        config = config_cls(**{**extra, "text_config": {**COMMON, **extra["text_config"]}})
    else:
        config = config_cls(**{**COMMON, **extra})
    # Eager attention and the per-expert loop: the exact reference, not a fused kernel.
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def build_tiny_hf_model(family: str, seed: int = 0):
    _, model_cls, _ = ALL_FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(tiny_hf_config(family)).eval()
    with torch.no_grad():
        # Biases and norm weights start at 0 / 1; randomise them so they are really tested.
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        # DeepSeek-V3's expert-choice correction is a buffer: non-zero so it is really tested.
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.3 * torch.randn_like(b))
    return model


def save_tiny_hf_model(family: str, path: Path, *, max_shard_size: str | None = None, seed: int = 0) -> Path:
    model = build_tiny_hf_model(family, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return Path(path)


def fused_expert_state(model, state: dict) -> dict:
    """Per-expert tensors (as saved) back into transformers' fused expert parameters."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for name, _ in model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            base, n = name[: -len("gate_up_proj")], model.config.n_routed_experts
            out[name] = torch.stack([torch.cat([state[f"{base}{e}.gate_proj.weight"], state[f"{base}{e}.up_proj.weight"]])
                                     for e in range(n)])
            out[base + "down_proj"] = torch.stack([state[f"{base}{e}.down_proj.weight"] for e in range(n)])
    return out


def quantized_release(family: str, seed: int, tmp: Path, quantize) -> tuple[dict, torch.nn.Module]:
    """A tiny HF model's tensors re-encoded as a quantized release, and the reference: the HF
    model on the values the encoding stands for. `quantize(name, value)` returns None to keep
    a tensor as it is, else (the tensors stored in its place, the float32 values they mean)."""
    from safetensors.torch import load_file

    model = build_tiny_hf_model(family, seed=seed)
    model.save_pretrained(tmp)
    tensors = {k: v.numpy() for k, v in load_file(Path(tmp) / "model.safetensors").items()}
    stored, meant = {}, {}
    for name, value in tensors.items():
        encoded = quantize(name, value)
        if encoded is None:
            stored[name] = value
        else:
            stored_here, meant[name] = encoded
            stored.update(stored_here)
    state = {k: torch.from_numpy(meant.get(k, v)) for k, v in tensors.items()}
    model.load_state_dict(fused_expert_state(model, state), strict=True)
    return stored, model


def grouped_matmul_reference(xs, dense, sizes):
    """What a grouped expert matmul must give: rows xs [a, in], sorted by expert, each expert's
    sizes[e] rows times its dense [in, out] weights, one plain matmul per expert; rows past
    sum(sizes) zero."""
    import numpy as np

    want, row = np.zeros((xs.shape[0], dense.shape[-1]), np.float32), 0
    for e, n in enumerate(sizes):
        want[row:row + n] = xs[row:row + n] @ dense[e]
        row += n
    return want


def assert_conversion_keeps_params(src, dst, compress: bool):
    """`jfire convert` of src into dst (bf16 when compressed, else float32) loads as the same
    config and the same params, dtype and values, as src itself; returns the converted model."""
    import jax
    import numpy as np

    from jfire.checkpoint.convert import convert
    from jfire.checkpoint.load import load_model

    dtype = "bfloat16" if compress else "float32"
    dst = convert(src, dst, dtype, progress=False, compress=compress)
    source, converted = load_model(str(src), dtype), load_model(str(dst), dtype)
    assert converted.config == source.config
    for a, b in zip(jax.tree.leaves(source.params), jax.tree.leaves(converted.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return converted


def hf_text_model(path, dtype=torch.float32):
    """The HF causal LM to compare a saved directory against: eager attention, eager experts.

    For a multimodal Llama 4 directory this is the text model inside it
    (Llama4ForConditionalGeneration.language_model, a Llama4ForCausalLM): the outer model's own
    forward fails on text-only input in transformers 5.24.
    """
    kwargs = dict(attn_implementation="eager", experts_implementation="eager", dtype=dtype)
    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    if model_type == "llama4":
        return transformers.Llama4ForConditionalGeneration.from_pretrained(path, **kwargs).language_model.eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def save_byte_tokenizer(path: Path) -> Path:
    """A byte-level tokenizer whose 256 ids are the 256 bytes: it fits the tiny models'
    vocabulary, so they can be served and asked text prompts over HTTP."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(Path(path) / "tokenizer.json"))
    return Path(path)
