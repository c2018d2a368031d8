"""The engine limits the tests' servers, deployments and colocated references share.

One set, so that their programs are the same and each is compiled once per run: the
persistent compilation cache (tests/conftest.py) hands it to every later process: 3 decode and
5 prefill programs at each of 2 page-table widths (the context holds the tool-call prompts,
~300 tokens, with room to answer). Deployments differ only in a smaller page pool, which their
tests fill on purpose; their groups are processes 1 and 2 of a cluster, whose programs are
kept apart from a lone process's anyway (jfire.compile_cache)."""

from __future__ import annotations

MAX_BATCH = 4
CONTEXT = 512
COMMON = ["--max-batch", str(MAX_BATCH), "--prefill-budget", "64", "--max-context", str(CONTEXT)]
SERVE_LIMITS = [*COMMON, "--kv-cache-gb", "0.04"]  # 58 pages of the default model: two full contexts
DEPLOYMENT_LIMITS = [*COMMON, "--kv-cache-gb", "0.02"]  # 29 pages: less than one full context


def serve_engine_config(**overrides):
    """SERVE_LIMITS as the EngineConfig of an in-process engine, whose programs are then the
    servers' (overrides that change no shape: aot, prefix_caching; max_batch sizes the
    sampling state every program takes, so it stays)."""
    from jfire.engine import EngineConfig

    limits = dict(max_batch=MAX_BATCH, prefill_budget=64, max_model_len=CONTEXT, kv_cache_bytes=int(0.04 * (1 << 30)))
    return EngineConfig(**{**limits, **overrides})
