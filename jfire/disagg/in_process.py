"""A prefill engine and a decode engine in one process, their KV carried through host memory.

The smallest pair of connectors written against `jfire.kv_connector` alone: the prefill side
gathers a finished prompt's pages and leaves copies in a shared `HostKVStore`; the decode side
admits a prefilled request once its pool has pages for all of it, writes the copies into them
and lets the request join its batch. Tests use it to check the connector protocol without
processes or a transfer server; it is also the shape of a host-memory tier's save and load.
"""

from __future__ import annotations

import itertools
import threading

import jax
import numpy as np

from jfire.disagg.kv_transfer import kv_layout, transfer_programs
from jfire.kv_connector import Failed, KVConnector, Loaded, Progress, check_prefilled, prompt_only
from jfire.outputs import LiveRequest
from jfire.sampling import SamplingParams
from jfire.scheduler import Sequence


class HostKVStore:
    """Pages' contents in host memory, by transfer id, until taken once."""

    def __init__(self):
        self._entries: dict[int, tuple[list[np.ndarray], int]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def put(self, arrays: list[np.ndarray], checksum: int) -> int:
        with self._lock:
            key = next(self._ids)
            self._entries[key] = (arrays, checksum)
            return key

    def take(self, key: int) -> tuple[list[np.ndarray], int]:
        with self._lock:
            return self._entries.pop(key)

    def __len__(self) -> int:
        return len(self._entries)


class InProcessPrefill(KVConnector):
    role = "prefill"
    program_kinds = ("prefill",)
    pages_by_id = True
    ends_after_prompt = True

    def __init__(self, store: HostKVStore):
        self.store = store

    def bind(self, engine) -> None:
        super().bind(engine)
        self.gather = transfer_programs(engine, kv_layout(engine), "gather")

    def side_programs(self) -> list:
        return [self.gather]

    def check(self, request_id, prompt_ids, sampling: SamplingParams, kv_params) -> SamplingParams:
        return prompt_only(request_id, sampling)

    def request_finished(self, seq: Sequence, kv_params) -> dict:
        pages = seq.pages[: self.engine.scheduler.pages_needed(len(seq.prompt_ids))]
        arrays, checksum = self.gather.gather(self.engine.runner.pages, pages)
        key = self.store.put([np.asarray(a) for a in arrays], checksum)
        return {"key": key, "num_pages": len(pages), "checksum": checksum}


class InProcessDecode(KVConnector):
    role = "decode"
    program_kinds = ("decode",)
    pages_by_id = True

    def __init__(self, store: HostKVStore):
        self.store = store
        self._waiting: list[LiveRequest] = []  # prefilled, waiting for pages
        self._cancelled: list[LiveRequest] = []  # cancelled while waiting: ended at the next update
        self.loaded = 0

    def bind(self, engine) -> None:
        super().bind(engine)
        self.insert = transfer_programs(engine, kv_layout(engine), "insert")
        self.device = next(iter(jax.tree.leaves(engine.runner.pages)[0].devices()))

    def side_programs(self) -> list:
        return [self.insert]

    def check(self, request_id, prompt_ids, sampling: SamplingParams, kv_params) -> SamplingParams:
        check_prefilled(request_id, kv_params, sampling)
        return sampling

    def loads(self, live: LiveRequest) -> bool:
        return True

    def hold(self, live: LiveRequest) -> None:
        self._waiting.append(live)

    def cancel(self, request_id: str) -> None:
        for live in self._waiting:
            if live.seq.request_id == request_id:
                self._waiting.remove(live)
                self._cancelled.append(live)
                return

    def held_requests(self) -> list[LiveRequest]:
        held, self._waiting, self._cancelled = [*self._waiting, *self._cancelled], [], []
        return held

    def has_pending(self) -> bool:
        return bool(self._waiting)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def update(self) -> Progress:
        progress = Progress(failed=[Failed(live, None) for live in self._cancelled])
        self._cancelled = []
        scheduler, pool = self.engine.scheduler, self.engine.pool
        while self._waiting and len(scheduler.running) < self.engine.config.max_batch:
            live = self._waiting[0]
            seq, kv = live.seq, live.kv_params or {}
            pages = pool.allocate(scheduler.pages_needed(len(seq.prompt_ids) + seq.sampling.max_tokens))
            if pages is None:
                break  # admitted once enough pages are free
            self._waiting.pop(0)
            transfer = kv["transfer"]
            arrays, sent = self.store.take(transfer["key"])
            n = transfer["num_pages"]
            runner = self.engine.runner
            runner.pages, arrived = self.insert.insert(
                runner.pages, [jax.device_put(a, self.device) for a in arrays], pages[:n]
            )
            if arrived != sent:
                pool.free(pages)
                progress.failed.append(Failed(live, f"the KV arrived with checksum {arrived:#x}, sent {sent:#x}"))
                continue
            seq.pages = pages
            self.loaded += 1
            progress.loaded.append(Loaded(live, int(kv["first_token"]), kv.get("first_logprobs")))
        return progress

    def poll_interval(self) -> float | None:
        return 0.002 if self._waiting else None
