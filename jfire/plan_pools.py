"""`jfire plan`'s KV pools: the page pools an engine sizes in what is free on the device with the
least room, and the plan's JSON fields that describe them (docs/plan.md, "The KV pools").

The pools are sized exactly as the engine sizes them (`kv_pools`: `jfire.runner.pool_size` itself,
over each cache group's bytes of a page on a device, `group_page_bytes`). A model whose layers
attend different spans has a pool per kind of layer (`Family.cache_groups()`): each windowed group
(a sliding window, Llama 4's chunks) gets every row's window, `--max-batch` rows of the most pages
a row holds of it at once, and the full-attention group the rest.
"""

from __future__ import annotations

import functools
import math

from jfire import sharding
from jfire.models.family import Family
from jfire.plan_bytes import GIB, _pages_split, kv_bytes_per_token


def group_page_bytes(cfg: Family, mesh, cache_shardings: dict, page_size: int, dtype) -> dict[str, int]:
    """Bytes of one page of each cache group on the device holding the most of it: the engine's
    own figures (`jfire.runner.pool_size` sizes its pools with them)."""
    from jfire.kv_cache import page_bytes

    return {
        g.name: sharding.page_bytes_per_device(cfg, page_size, dtype, cache_shardings, g.name)
        if mesh is not None
        else page_bytes(cfg, page_size, dtype, g.name)
        for g in cfg.cache_groups()
    }


def kv_pools(
    cfg: Family,
    mesh,
    cache_shardings: dict,
    dtype,
    budget: int,
    *,
    page_size: int,
    max_batch: int,
    prefill_budget: int,
    max_model_len: int,
    shared: bool = False,
) -> tuple[dict[str, int], bool]:
    """(pages per cache group, shared) of the pools an engine sizes from `budget` bytes a
    device: `jfire.runner.pool_size` itself, given the model's config, KV dtype and mesh (each
    windowed group its rows' windows, the full-attention groups the rest: kv_cache.pool_pages;
    one pool for all where that holds no fewer pages of full attention, or where `shared`),
    for the most bytes of whole pages within the budget (the engine rounds a split pages axis
    up to whole multiples of the split). No pages where the budget holds none."""
    from jfire.engine_config import EngineConfig
    from jfire.runner import pool_size

    per_page = group_page_bytes(cfg, mesh, cache_shardings, page_size, dtype)
    step = _pages_split(cfg, cache_shardings) * sum(per_page.values())
    nbytes = budget
    while nbytes >= sum(per_page.values()):
        config = EngineConfig(
            page_size=page_size, kv_cache_bytes=nbytes, max_batch=max_batch, prefill_budget=prefill_budget
        )
        counts, one_pool = pool_size(cfg, dtype, mesh, config, max_model_len, shared)
        used = pool_bytes(counts, per_page)
        if used <= budget:
            return counts, one_pool
        nbytes = min(nbytes, used) - step
    return dict.fromkeys(per_page, 0), False


def pool_bytes(counts: dict[str, int], per_page: dict[str, int]) -> int:
    return sum(n * per_page[name] for name, n in counts.items())


def kv_pool_fields(
    cfg: Family,
    mesh,
    cache_shardings: dict,
    kv_type,
    budget: int,
    *,
    page_size: int,
    max_batch: int,
    prefill_budget: int,
    max_model_len: int,
) -> dict:
    """The plan's fields for the pools an engine sizes from `budget` bytes a device (`kv_pools`),
    from `kv_budget_bytes_per_device` to `kv_cache_bytes_per_device`: the tokens of context they
    hold with every row's window reserved, the most one sequence may hold, each cache group's
    pool, and the bytes a device needs for one full context."""
    groups = cfg.cache_groups()
    per_page = group_page_bytes(cfg, mesh, cache_shardings, page_size, kv_type)
    pools = functools.partial(
        kv_pools,
        cfg,
        mesh,
        cache_shardings,
        kv_type,
        page_size=page_size,
        max_batch=max_batch,
        prefill_budget=prefill_budget,
        max_model_len=max_model_len,
    )
    group_pages, shared = pools(budget)
    kv_cache_bytes = pool_bytes(group_pages, per_page)  # per device: what the engine is given
    one_pool = pools(kv_cache_bytes, shared=True)[0]
    full = [g for g in groups if not g.windowed]
    pages = max(group_pages[g.name] for g in full or groups)  # what EngineConfig.num_pages means: a full group's
    capacity = pages * page_size
    step_tokens = max(prefill_budget, 2)  # as the engine steps its rows (jfire.runner.pool_size)
    row_pages = {g.name: g.pages_per_row(max_model_len, page_size, step_tokens) for g in groups}
    per_sequence = max_model_len
    for g in groups:
        if not g.windowed or group_pages[g.name] < row_pages[g.name]:  # a window that fits slides on
            per_sequence = min(per_sequence, group_pages[g.name] * page_size)
    kv_groups = {
        g.name: {
            "attends": "chunk" if g.chunk else "sliding window" if g.sliding_window else "all",
            "window": g.chunk or g.sliding_window,
            "pages": group_pages[g.name],
            "pages_per_row": row_pages[g.name],
            "page_bytes_per_device": per_page[g.name],
            "bytes_per_device": group_pages[g.name] * per_page[g.name],
            "kv_bytes_per_token": sum(kv_bytes_per_token(cfg, cache_shardings, kv_type, g.name).values()),
        }
        for g in groups
    }
    # One full context beside every row's window (a windowed group's rows, a full group's one
    # row), or in one pool (each group a whole row): the least bytes a device needs to fit one;
    # where every group is windowed, one row's windows.
    whole = -(-max_model_len // page_size)
    by_kind = sum((max_batch * row_pages[g.name] if g.windowed else whole) * per_page[g.name] for g in groups)
    context_bytes = min(by_kind, whole * sum(per_page.values()))
    if not full:
        context_bytes = sum(row_pages[g.name] * per_page[g.name] for g in groups)
    return {
        "kv_budget_bytes_per_device": budget,
        "kv_capacity_tokens": capacity,
        "max_tokens_per_sequence": per_sequence,
        "kv_capacity_note": (
            "kv_capacity_tokens: the tokens of context the pools hold once every row's window is reserved "
            "(each windowed group --max-batch rows of the most pages a row holds of it at once): a full-attention "
            "group's pages x page_size, or, where every group is windowed, their pages x page_size; "
            "max_tokens_per_sequence: the most one sequence may hold (at most --max-context); kv_groups: "
            "each cache group's pool (pages, the bytes of a page and of the pool on the device with the "
            "least room, the most pages one row holds at once)"
        ),
        "page_size": page_size,
        "kv_pages": pages,
        "kv_groups": kv_groups,
        "kv_pools_shared": shared,
        "kv_pages_one_pool": max(one_pool.values()),
        "kv_context_bytes_per_device": context_bytes,
        "kv_cache_gb_per_device": math.floor(kv_cache_bytes / GIB * 100) / 100,
        "kv_cache_bytes_per_device": kv_cache_bytes,
    }
