"""Where a prompt's prefix lives: the frontend's index of the prompt blocks each prefill group
has computed, for routing a request to the group that holds its longest prefix.

The index is built from the frontend's own decisions (the blocks of every prompt it sent to a
group), as SGLang's cache-aware router and NVIDIA Dynamo's approximate KV router build theirs:
it costs the groups nothing and is exact except for eviction, which it approximates by keeping,
per group, only as many blocks as that group's caches hold (device pages plus its host tier),
least recently used dropped first. A wrong guess costs one recomputed prefix, never a wrong
answer: the group looks its own cache up, by the same block hashes.

A group that goes down or restarts loses its caches, and its entries with them.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from jfire.kv_cache import block_hashes


class PrefixIndex:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self._blocks: dict[str, collections.OrderedDict[bytes, None]] = {}
        self._capacity: dict[str, int] = {}
        self._lock = threading.Lock()

    def hashes(self, prompt_ids: Sequence[int], extra_keys=None, cache_salt: str | None = None) -> list[bytes]:
        """The prompt's full blocks as the groups hash them (jfire.kv_cache.block_hashes;
        `extra_keys`: its images', jfire.vision.encoder.RequestImages.extra_keys; `cache_salt`:
        the request's, SamplingParams.cache_salt)."""
        return block_hashes(prompt_ids, self.page_size, salt=cache_salt, extra_keys=extra_keys)

    def set_capacity(self, group: str, blocks: int) -> None:
        """How many blocks the group's caches hold; the index keeps no more for it."""
        with self._lock:
            self._capacity[group] = max(1, blocks)
            self._trim(group)

    def matched(self, group: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` the group is thought to hold."""
        with self._lock:
            held = self._blocks.get(group)
            n = 0
            if held:
                for h in hashes:
                    if h not in held:
                        break
                    n += 1
            return n

    def record(self, group: str, hashes: Sequence[bytes]) -> None:
        """The group has computed (or reused) these blocks: most recently used now."""
        with self._lock:
            held = self._blocks.setdefault(group, collections.OrderedDict())
            for h in hashes:
                held[h] = None
                held.move_to_end(h)
            self._trim(group)

    def forget(self, group: str) -> None:
        """The group's caches are gone (it went down, or restarted)."""
        with self._lock:
            self._blocks.pop(group, None)

    def blocks(self, group: str) -> int:
        with self._lock:
            return len(self._blocks.get(group, ()))

    def _trim(self, group: str) -> None:
        held, capacity = self._blocks.get(group), self._capacity.get(group)
        if held is None or capacity is None:
            return
        while len(held) > capacity:
            held.popitem(last=False)
