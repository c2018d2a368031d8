"""The engine limits the tests' servers, deployments and colocated references share.

One set, so that their programs are the same and each is compiled once per run (the persistent
compilation cache of tests/conftest.py hands it to every later process): 3 decode and 5
prefill programs (the context holds the tool-call prompts, ~300 tokens, with room to answer). Deployments differ only in a smaller page pool, which their
tests fill on purpose; their groups are processes 1 and 2 of a cluster, whose programs are
kept apart from a lone process's anyway (jfire.compile_cache)."""

from __future__ import annotations

MAX_BATCH = 4
PREFILL_BUDGET = 64
CONTEXT = 512
SERVE_KV_GB = 0.04  # 58 pages of the default model: two full contexts
DEPLOYMENT_KV_GB = 0.02  # 29 pages: less than one full context

_COMMON = ["--max-batch", str(MAX_BATCH), "--prefill-budget", str(PREFILL_BUDGET),
           "--max-context", str(CONTEXT)]
SERVE_LIMITS = [*_COMMON, "--kv-cache-gb", str(SERVE_KV_GB)]
DEPLOYMENT_LIMITS = [*_COMMON, "--kv-cache-gb", str(DEPLOYMENT_KV_GB)]


def serve_engine_config(**overrides):
    """SERVE_LIMITS as the EngineConfig of an in-process engine, whose programs are then the
    servers' (overrides that change no shape: aot, prefix_caching; max_batch sizes the
    sampling state every program takes, so it stays)."""
    from jfire.engine import EngineConfig

    limits = dict(max_batch=MAX_BATCH, prefill_budget=PREFILL_BUDGET, max_model_len=CONTEXT,
                  kv_cache_bytes=int(SERVE_KV_GB * (1 << 30)))  # as `jfire` turns --kv-cache-gb into bytes
    return EngineConfig(**{**limits, **overrides})
