"""Model families. Each family module exposes a frozen config dataclass with `from_hf()` /
`from_gguf()` / `param_specs()`, and pure `forward` / `decoder` functions."""

from jfire.models.llama import SUPPORTED_ARCHITECTURES, LlamaConfig

__all__ = ["LlamaConfig", "SUPPORTED_ARCHITECTURES"]
