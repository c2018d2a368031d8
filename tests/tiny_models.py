"""Tiny random models of every supported family, built and saved with transformers."""

from __future__ import annotations

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


def build_tiny_hf_model(family: str, seed: int = 0):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        # Biases and norm weights start at 0 / 1; randomise them so they are really tested.
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_tiny_hf_model(family: str, path: Path, *, max_shard_size: str | None = None, seed: int = 0) -> Path:
    model = build_tiny_hf_model(family, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return Path(path)
