"""An engine's settings: the page pool, batch and step limits, compilation and the kernels."""

from __future__ import annotations

import dataclasses

from jfire.errors import JfireError

# The attention backends (jfire.programs.decode_attention chooses among them, for decode and prefill).
ATTENTION_IMPLS = ("reference", "pallas", "pallas-interpret")
SPECULATIVE = ("ngram", "suffix", "mtp", "eagle3")  # the drafters (jfire.speculative.drafters)
MODEL_DRAFTERS = ("mtp", "eagle3")  # those that run a draft model inside the programs (jfire.speculative.model_drafts)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    # Pages of each cache group's pool (a windowed group's no more than its rows' windows);
    # default: as many as kv_cache_bytes holds (jfire.runner.pool_size).
    num_pages: int | None = None
    kv_cache_bytes: int = 1 << 30
    # A page pool per kind of layer (full attention, sliding window, chunks), a windowed
    # group's pages given back as they leave its window; False: one pool keeping every page.
    # A connector moving pages by id (disaggregation, a host tier) always gets one pool.
    pool_per_kind: bool = True
    max_batch: int = 64
    prefill_budget: int = 256  # prompt tokens per step: bounds how long a step stalls decodes
    max_prefill_rows: int = 16
    max_model_len: int | None = None  # default: the model's context, capped at 4096
    max_waiting: int = 1024
    prefix_caching: bool = True
    attention: str = "reference"
    compile_workers: int = 2
    aot: bool = True  # compile every bucket at start-up; False compiles each on first use
    # Serve once the essential programs exist and compile the rest in the background (with aot).
    serve_while_compiling: bool = True
    # Steady decoding dispatches each step before reading the previous step's ids (the ids
    # stay on the device and feed the next step): the host's work overlaps the device's. Off
    # with a draft model: each step's drafts are read before the next step is planned.
    run_ahead: bool = True
    # On one CPU device computing in float32 (float32 or bfloat16 weights), products read each
    # layer's weights where they lie in the stack, and decode attention each page's keys and
    # values where they lie (jfire.kernels.cpu_matmul, cpu_attention), instead of XLA:CPU
    # copying them out first.
    cpu_kernels: bool = True
    # Compile with XLA's backend optimisation off (programs.QUICK_COMPILE): faster start-up,
    # slower steps. For tiny models and trying things out, not for serving a real model.
    quick_compile: bool = False
    compilation_cache_dir: str | None = None  # JAX's persistent cache; None = off
    # Speculative decoding (jfire.speculative): the drafter ("ngram", "suffix"; None: off),
    # the most draft tokens a row verifies in one step, and the largest decode batch that
    # drafts (a bigger batch is compute-bound enough that verifying drafts costs throughput).
    speculative: str | None = None
    # None: 16 for the model-free drafters (their drafts cost nothing to make, and the
    # speculator verifies as much of a draft as pays), 8 for a draft model (a layer a token).
    num_draft_tokens: int | None = None
    draft_model: str | None = None  # an EAGLE-3 head's directory (speculative "eagle3")
    speculative_max_rows: int = 4

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLS:
            raise JfireError(f"unknown attention {self.attention!r}; use one of {', '.join(ATTENTION_IMPLS)}")
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            raise JfireError(f"unknown drafter {self.speculative!r}; use one of {', '.join(SPECULATIVE)}")
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", 8 if self.speculative in MODEL_DRAFTERS else 16)
        if not 1 <= self.num_draft_tokens <= 16:
            raise JfireError(f"num_draft_tokens must be in [1, 16], got {self.num_draft_tokens}")
        if self.speculative in MODEL_DRAFTERS:
            object.__setattr__(self, "run_ahead", False)
