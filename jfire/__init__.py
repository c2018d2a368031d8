"""jfire: an LLM inference engine on JAX/XLA."""

__version__ = "0.1.0"
