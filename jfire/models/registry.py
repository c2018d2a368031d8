"""Which family reads which model: HF `architectures` / `model_type`, GGUF
`general.architecture`, and the `family` a jfire checkpoint records."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jfire.errors import JfireError
from jfire.models import deepseek, llama, llama4
from jfire.models.family import Family

FAMILIES: dict[str, type[Family]] = {
    llama.LlamaConfig.family: llama.LlamaConfig,
    llama4.Llama4Config.family: llama4.Llama4Config,
    deepseek.DeepseekV3Config.family: deepseek.DeepseekV3Config,
}
HF_ARCHITECTURES: dict[str, type[Family]] = {
    **{arch: llama.LlamaConfig for arch in llama.SUPPORTED_ARCHITECTURES},
    **{arch: llama4.Llama4Config for arch in llama4.SUPPORTED_ARCHITECTURES},
    **{arch: deepseek.DeepseekV3Config for arch in deepseek.SUPPORTED_ARCHITECTURES},
}
# HF model_type -> architecture, for configs that name no architecture.
HF_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "kimi_k25": "KimiK25ForConditionalGeneration",
}
GGUF_ARCHITECTURES: dict[str, type[Family]] = {arch: llama.LlamaConfig for arch in llama.GGUF_ARCHITECTURES}


def config_from_hf(hf: Mapping[str, Any]) -> Family:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else HF_MODEL_TYPES.get(hf.get("model_type"))
    family = HF_ARCHITECTURES.get(arch)
    if family is None:
        raise JfireError(
            f"unsupported architecture {arch!r} in config.json; jfire supports " + ", ".join(sorted(HF_ARCHITECTURES))
        )
    return family.from_hf({**hf, "architectures": [arch]})


def config_from_gguf(meta: Mapping[str, Any], has_output_tensor: bool) -> Family:
    arch = meta.get("general.architecture")
    family = GGUF_ARCHITECTURES.get(arch)
    if family is None:
        raise JfireError(
            f"unsupported GGUF architecture {arch!r}; jfire supports " + ", ".join(sorted(GGUF_ARCHITECTURES))
        )
    return family.from_gguf(meta, has_output_tensor)


def config_from_dict(family: str, d: Mapping[str, Any]) -> Family:
    """A config saved in a checkpoint manifest (`family` and `config`)."""
    cls = FAMILIES.get(family)
    if cls is None:
        raise JfireError(
            f"this checkpoint is of model family {family!r}, which this jfire does not know "
            f"(families: {', '.join(sorted(FAMILIES))})"
        )
    return cls.from_dict(d)
