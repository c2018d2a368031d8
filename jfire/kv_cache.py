"""The paged KV cache, in two parts.

Host: `BlockPool` owns page ids: a free list, reference counts, and the hashes of full pages
so a prompt that shares whole pages with an earlier one reuses them (prefix caching).
Device: `init_pages` builds the page arrays the model family declares (`cache_specs()`: e.g.
keys and values `[layers, kv_heads, pages, page_size, head_dim]`) that every program call
receives donated and returns updated. The pool only counts pages; what a page holds is the
family's business.

A family's layers fall into cache groups by what they attend (`Family.cache_groups()`: full
attention, a sliding window, chunks). `KVPools` gives each group its own BlockPool and page
count (`pool_pages`): a windowed group needs only its rows' windows, so the bytes it would
have spent on positions no query sees again go to the full-attention group. With `shared`,
every group uses one pool (the same page ids in every array) and keeps every page: what a
connector that moves pages by id (a KV transfer, a host tier) works with.

A freed page that holds a full, hashed block stays findable until it is handed out again:
the free list is least-recently-freed first, so popular prefixes survive longest.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jfire.models.family import CacheGroup, Family


def init_pages(
    cfg: Family, num_pages: int | dict[str, int], page_size: int, dtype, shardings: dict | None = None
) -> dict:
    """Zeroed page arrays, created directly with their shardings (each device allocates its
    part). `num_pages`: one count for every array, or a count per cache group."""
    counts = num_pages if isinstance(num_pages, dict) else {g.name: num_pages for g in cfg.cache_groups()}
    return {
        c.name: jnp.zeros(c.shape(counts[c.group], page_size), dtype, device=(shardings or {}).get(c.name))
        for c in cfg.cache_specs()
    }


def page_bytes(cfg: Family, page_size: int, dtype, group: str | None = None) -> int:
    """Bytes one page takes across all layers and cache arrays (or those of one cache group)."""
    return cfg.kv_bytes_per_token(dtype, group) * page_size


def pool_pages(
    groups: tuple[CacheGroup, ...],
    group_page_bytes: dict[str, int],
    budget_bytes: float,
    *,
    rows: int,
    max_len: int,
    page_size: int,
    step_tokens: int,
    shared: bool = False,
) -> tuple[dict[str, int], bool]:
    """(pages per group, shared) for a cache of `budget_bytes`: each windowed group gets what
    `rows` rows hold of it at once (`CacheGroup.pages_per_row`, rows stepping up to
    `step_tokens` tokens), and the full-attention groups share the rest, the same number of
    pages each. One shared pool (the same count in every group, `shared` True) where that
    holds no fewer pages of full attention, or where every group is alike; a model whose
    every group is windowed gives each all it can hold (pages past the windows keep cached
    prefixes). `shared`: one pool whatever (a connector moves pages by id)."""
    total = sum(group_page_bytes[g.name] for g in groups)
    one_pool = {g.name: max(1, int(budget_bytes // total)) for g in groups}
    windowed = [g for g in groups if g.windowed]
    full = [g for g in groups if not g.windowed]
    if shared or not windowed or not full:
        return one_pool, shared or len(groups) > 1
    counts = {g.name: rows * g.pages_per_row(max_len, page_size, step_tokens) for g in windowed}
    rest = budget_bytes - sum(counts[n] * group_page_bytes[n] for n in counts)
    full_pages = int(rest // sum(group_page_bytes[g.name] for g in full)) if rest > 0 else 0
    if full_pages <= one_pool[full[0].name]:
        return one_pool, True
    return {**counts, **{g.name: full_pages for g in full}}, False


def block_hashes(
    token_ids: Sequence[int],
    page_size: int,
    *,
    salt: bytes | str | None = None,
    extra_keys: Callable[[int, int], bytes] | None = None,
) -> list[bytes]:
    """Chained hashes of each full page of tokens: a page's hash covers everything before it.
    What the KV depends on besides the token ids goes in too, so equal ids never share pages
    they should not: `salt` seeds the chain (a request's cache salt, SamplingParams.cache_salt:
    prompts of different salts never find each other's blocks, in the device pool, a host tier
    or another group), and `extra_keys(start, end)` gives the bytes of what else block
    [start, end) holds (the hash of an image whose placeholder tokens fall in it)."""
    if isinstance(salt, str):
        salt = salt.encode()
    hashes, parent = [], hashlib.blake2b(salt, digest_size=16).digest() if salt else b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        block = np.asarray(token_ids[start : start + page_size], np.int64).tobytes()
        if extra_keys is not None:
            block += extra_keys(start, start + page_size)
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclasses.dataclass
class PoolStats:
    total: int
    used: int  # referenced by at least one request
    free: int  # unreferenced (some of them still hold reusable prefixes)
    cached: int  # free pages still holding a hashed prefix block


class BlockPool:
    """Page ids and their bookkeeping; the engine thread is its only user."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError("a block pool needs at least one page of at least one slot")
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref_count = np.zeros(num_pages, np.int32)
        # Ordered by when the page was freed: allocation takes the oldest first.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict((i, None) for i in range(num_pages))
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}
        # How many prompts a page's block has served: the one that computed it, then each that
        # found it (a host tier's reuse gating reads it).
        self.uses = np.zeros(num_pages, np.int32)
        # Called with the (page, block hash, uses) of the cached blocks allocate() is about to
        # hand out, before anything overwrites them: a host tier copies them out here.
        self.on_evict: Callable[[list[tuple[int, bytes, int]]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def stats(self) -> PoolStats:
        cached = sum(1 for p in self._free if p in self._hash_of_page)
        return PoolStats(self.num_pages, self.num_pages - self.num_free, self.num_free, cached)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        pages, evicted = [], []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            h = self._forget(page)
            if h is not None:
                evicted.append((page, h, int(self.uses[page])))
            self.uses[page] = 0
            self.ref_count[page] = 1
            pages.append(page)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        # Freed in reverse so a request's tail pages are reused before its prefix pages.
        for page in reversed(pages):
            self.ref_count[page] -= 1
            assert self.ref_count[page] >= 0, f"page {page} freed twice"
            if self.ref_count[page] == 0:
                self._free[page] = None

    def retain(self, pages: Sequence[int]) -> None:
        """One more reference to pages already in use (a KV transfer holding them)."""
        for page in pages:
            assert self.ref_count[page] > 0, f"page {page} retained while free"
            self.ref_count[page] += 1

    def lookup_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Pages holding the longest run of these leading blocks, each now referenced once more."""
        pages = []
        for h in hashes:
            page = self._page_of_hash.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self.ref_count[page] == 0:
                del self._free[page]
            self.ref_count[page] += 1
            self.uses[page] += 1
        return pages

    def cached_run(self, hashes: Sequence[bytes]) -> int:
        """How many of these leading blocks the pool holds (used or cached), taking nothing."""
        for n, h in enumerate(hashes):
            if h not in self._page_of_hash:
                return n
        return len(hashes)

    def page_of(self, block_hash: bytes) -> int | None:
        """The page holding this block, if any (used or cached), without taking a reference:
        valid until the engine thread next allocates."""
        return self._page_of_hash.get(block_hash)

    def register(self, page: int, block_hash: bytes) -> None:
        """Marks a page as holding a full block with this hash (its KV has been written)."""
        if block_hash in self._page_of_hash or page in self._hash_of_page:
            return
        self._page_of_hash[block_hash] = page
        self._hash_of_page[page] = block_hash
        self.uses[page] = 1

    def _forget(self, page: int) -> bytes | None:
        h = self._hash_of_page.pop(page, None)
        if h is not None:
            del self._page_of_hash[h]
        return h


RELEASED = -1  # a page-table entry whose page went back to its pool (out of the group's window)


@dataclasses.dataclass
class GroupPool:
    """One cache group's pool, or one pool every group shares (its group then the full one)."""

    group: CacheGroup
    pool: BlockPool


class KVPools:
    """The engine's page pools: one per cache group, or one shared by all (`shared`). A
    sequence's `tables[i]` lists its pages in pool i, by page of its positions; a windowed
    group's entries before its window are RELEASED."""

    def __init__(self, groups: tuple[CacheGroup, ...], num_pages: dict[str, int], page_size: int, shared: bool):
        self.page_size = page_size
        self.groups = groups
        self.shared = shared
        if shared:
            one = BlockPool(max(num_pages.values()), page_size)
            self.pools = [GroupPool(CacheGroup("shared"), one)]
            self.index = dict.fromkeys((g.name for g in groups), 0)
        else:
            self.pools = [GroupPool(g, BlockPool(num_pages[g.name], page_size)) for g in groups]
            self.index = {g.name: i for i, g in enumerate(groups)}

    @property
    def first(self) -> BlockPool:
        """The pool a connector moving pages by id works with (the only one, when shared)."""
        return self.pools[0].pool

    def pages_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    def grow(self, tables: list[list[int]], num_positions: int) -> bool:
        """Pages in every pool for positions up to num_positions; False (nothing taken) when a
        pool has too few free."""
        need = self.pages_needed(num_positions)
        taken: list[tuple[int, int]] = []  # (pool, pages taken) so far
        for i, (gp, table) in enumerate(zip(self.pools, tables)):
            if need <= len(table):
                continue
            pages = gp.pool.allocate(need - len(table))
            if pages is None:
                for j, n in taken:
                    self.pools[j].pool.free(tables[j][-n:])
                    del tables[j][-n:]
                return False
            table += pages
            taken.append((i, len(pages)))
        return True

    def free(self, tables: list[list[int]]) -> None:
        """Gives back every page the tables hold and empties them."""
        for gp, table in zip(self.pools, tables):
            gp.pool.free([p for p in table if p != RELEASED])
            table.clear()

    def shrink(self, tables: list[list[int]], num_positions: int) -> None:
        """Gives back the pages past those positions up to num_positions need (a speculative
        step's lookahead pages its rejected drafts left)."""
        need = self.pages_needed(num_positions)
        for gp, table in zip(self.pools, tables):
            if len(table) > need:
                gp.pool.free([p for p in table[need:] if p != RELEASED])
                del table[need:]

    def release_behind(self, tables: list[list[int]], position: int) -> None:
        """Gives back the pages of windowed groups that no query at `position` or later sees."""
        for gp, table in zip(self.pools, tables):
            if not gp.group.windowed:
                continue
            stop = min(len(table), gp.group.first_visible(position) // self.page_size)
            behind = [p for p in table[:stop] if p != RELEASED]
            if behind:
                gp.pool.free(behind)
                table[:stop] = [RELEASED] * stop

    def cached_prefix(self, hashes: Sequence[bytes]) -> tuple[list[list[int]], int]:
        """(tables, blocks) for the longest run of these leading blocks every pool can serve:
        a full-attention pool all of them, a windowed pool those its window still needs after
        them; each page now referenced once more, the windowed entries before RELEASED."""
        blocks = len(hashes)
        for gp in self.pools:
            if not gp.group.windowed:
                blocks = min(blocks, gp.pool.cached_run(hashes))

        def served(k: int) -> bool:
            for gp in self.pools:
                if gp.group.windowed:
                    first = gp.group.first_visible(k * self.page_size) // self.page_size
                    if gp.pool.cached_run(hashes[first:k]) < k - first:
                        return False
            return True

        while blocks > 0 and not served(blocks):
            blocks -= 1
        tables = []
        for gp in self.pools:
            first = gp.group.first_visible(blocks * self.page_size) // self.page_size if gp.group.windowed else 0
            tables.append([RELEASED] * first + gp.pool.lookup_prefix(hashes[first:blocks]))
        return tables, blocks

    def register(self, tables: list[list[int]], first_block: int, hashes: Sequence[bytes]) -> None:
        """Marks blocks first_block.. of the tables as holding these blocks' KV (hashes[i] is
        block i's)."""
        for gp, table in zip(self.pools, tables):
            for i in range(first_block, len(hashes)):
                if table[i] != RELEASED:
                    gp.pool.register(table[i], hashes[i])

    def shortfall(self, num_positions: int, step_tokens: int) -> tuple[str, int, int] | None:
        """(group, pages needed, pages it has) of the first pool one sequence of num_positions
        positions can never fit in, or None."""
        for gp in self.pools:
            needed = gp.group.pages_per_row(num_positions, self.page_size, step_tokens)
            if needed > gp.pool.num_pages:
                return gp.group.name, needed, gp.pool.num_pages
        return None

    def stats(self) -> dict:
        """Pages over every pool (total, used, free, cached), and per group where there are several."""
        per = {gp.group.name: gp.pool.stats() for gp in self.pools}
        out: dict[str, object] = {
            "pages_total": sum(s.total for s in per.values()),
            "pages_used": sum(s.used for s in per.values()),
            "pages_free": sum(s.free for s in per.values()),
            "pages_cached": sum(s.cached for s in per.values()),
        }
        if len(per) > 1 or self.pools[0].group.windowed:
            out["kv_groups"] = {name: dataclasses.asdict(s) for name, s in per.items()}
        return out
