"""The serving core, unchanged, on mixture-of-experts families: a tiny Llama 4 (routed and
shared experts, chunked attention, NoPE layers), a tiny Qwen3-MoE with dense layers among
the MoE ones, and a tiny DeepSeek-V3 (latent attention over the latent paged cache, grouped
routing). Batched equals alone, prefix-cache hits give the same tokens as a cold run, and
preempted requests recompute to the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.sampling import SamplingParams

FAMILIES = ["llama4", "qwen3_moe_sparse", "deepseek_v3"]


def requests_for(model, count=12, seed=7):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        ids = [int(x) for x in rng.integers(3, model.config.vocab_size, size=int(rng.integers(4, 30)))]
        sampling = SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=20, ignore_eos=True)
        out.append((ids, sampling))
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tiny_hf_dir):
    return load_model(str(tiny_hf_dir(request.param)), "float32")


def limits(num_pages: int, prefix_caching: bool = True) -> EngineConfig:
    """Every engine here has the same limits but its pool, so the reference's programs are
    among the batched engine's and the module compiles two small sets (4 rows: the twelve
    requests join and leave a running batch), quickly (programs.QUICK_COMPILE)."""
    return EngineConfig(page_size=4, num_pages=num_pages, max_batch=4, prefill_budget=32, max_prefill_rows=4,
                        aot=False, max_model_len=128, prefix_caching=prefix_caching, quick_compile=True)


ROOMY, TIGHT = 512, 14  # pages of 4 slots: every row at full length; two or three rows


@pytest.fixture(scope="module")
def alone(model):
    """Each request run by itself (one row, no prefix cache) in a roomy engine: the reference."""
    with Engine(model, limits(ROOMY, prefix_caching=False)) as engine:
        return [engine.generate([r])[0].token_ids for r in requests_for(model)]


def test_batched_with_prefix_cache_equals_alone(model, alone):
    requests = requests_for(model)
    # Every request twice: the second copy's prompt pages come from the prefix cache.
    with Engine(model, limits(ROOMY)) as engine:
        first = [c.token_ids for c in engine.generate(requests)]
        second = [c.token_ids for c in engine.generate(requests)]
        stats = engine.stats()
    assert stats["prefix_hit_tokens"] > 0
    assert first == alone and second == alone


def test_preempted_requests_equal_running_alone(model, alone):
    with Engine(model, limits(TIGHT)) as engine:
        together = [c.token_ids for c in engine.generate(requests_for(model))]
        stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["pages_used"] == 0
    assert together == alone
