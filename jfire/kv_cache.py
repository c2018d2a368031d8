"""The paged KV cache, in two parts.

Host: `BlockPool` owns page ids: a free list, reference counts, and the hashes of full pages
so a prompt that shares whole pages with an earlier one reuses them (prefix caching).
Device: `init_pages` builds the page arrays the model family declares (`cache_specs()`: e.g.
keys and values `[layers, kv_heads, pages, page_size, head_dim]`) that every program call
receives donated and returns updated. The pool only counts pages; what a page holds is the
family's business.

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

from jfire.models.family import Family


def init_pages(cfg: Family, num_pages: int, page_size: int, dtype, shardings: dict | None = None) -> dict:
    """Zeroed page arrays, created directly with their shardings (each device allocates its part)."""
    return {
        c.name: jnp.zeros(c.shape(num_pages, page_size), dtype, device=(shardings or {}).get(c.name))
        for c in cfg.cache_specs()
    }


def page_bytes(cfg: Family, page_size: int, dtype) -> int:
    """Bytes one page takes across all layers and cache arrays."""
    return cfg.kv_bytes_per_token(dtype) * page_size


def block_hashes(
    token_ids: Sequence[int],
    page_size: int,
    *,
    salt: bytes = b"",
    extra_keys: Callable[[int, int], bytes] | None = None,
) -> list[bytes]:
    """Chained hashes of each full page of tokens: a page's hash covers everything before it.
    What the KV depends on besides the token ids goes in too, so equal ids never share pages
    they should not: `salt` seeds the chain (a cache salt, a model's identity), and
    `extra_keys(start, end)` gives the bytes of what else block [start, end) holds (the hash
    of an image whose placeholder tokens fall in it)."""
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
        # Called with the (page, block hash) pairs whose cached blocks allocate() is about to
        # hand out, before anything overwrites them: a host tier copies them out here.
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None

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
                evicted.append((page, h))
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
        return pages

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

    def _forget(self, page: int) -> bytes | None:
        h = self._hash_of_page.pop(page, None)
        if h is not None:
            del self._page_of_hash[h]
        return h
