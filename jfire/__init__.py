"""jfire: an LLM inference engine on JAX/XLA."""

import os

__version__ = "0.1.0"

# XLA:CPU compile options jfire sets unless the user's XLA_FLAGS names them. Read once, when
# JAX starts its CPU backend, so they are set here, on importing jfire, before any of its code
# touches JAX. They do not apply to GPU or TPU compiles.
#  - xla_cpu_use_fusion_emitters=false: XLA's older elemental emitters for loop fusions. On
#    the default model they run decode and prefill steps at the same speed as the newer
#    emitters and compile each program about 25% faster (measured in docs/performance.md).
CPU_XLA_FLAGS = {"xla_cpu_use_fusion_emitters": "false"}


def _default_cpu_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "").split()
    named = {f.lstrip("-").split("=", 1)[0] for f in flags}
    flags += [f"--{name}={value}" for name, value in CPU_XLA_FLAGS.items() if name not in named]
    os.environ["XLA_FLAGS"] = " ".join(flags)


_default_cpu_flags()
