"""Continuous batching: which requests decode and which prompt chunks prefill, each step.

The scheduler counts tokens. A sequence has `tokens` (prompt, then what it generated) of
which `computed` are in the KV cache. Each step:
  1. every running sequence whose prompt is done decodes one token (it gets a page when it
     crosses into a new one; if none is free the youngest sequence is preempted: its pages
     are freed and it is queued again to recompute, keeping what it generated);
  2. the rest of the step's token budget goes to prompt chunks: unfinished prompts first,
     then new sequences admitted from the waiting queue while pages and batch slots last.
Prefill chunks are bounded so a long prompt never stalls running decodes for long.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable

from jfire.kv_cache import KVPools, block_hashes
from jfire.sampling import SamplingParams


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's scheduling state; the engine adds its output side."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    computed: int = 0  # how many of `tokens` have their KV in the cache
    # Its pages in each of the engine's pools (KVPools.pools), by page of its positions.
    tables: list[list[int]] = dataclasses.field(default_factory=lambda: [[]])
    phase: Phase = Phase.WAITING
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    registered_blocks: int = 0  # full prompt blocks whose hashes are in the pool
    # Another sequence with the same prompt (n > 1): admitted once that one's prompt blocks are
    # cached, so it reuses them instead of computing them again.
    after: Sequence | None = None
    # The llguidance matcher of a constrained request: which tokens it may sample next.
    matcher: object | None = None
    # A draft model's tokens after the last step that touched it (jfire.speculative.model_drafts).
    model_draft: list[int] = dataclasses.field(default_factory=list)
    # Its images and where their rows go in the prompt (jfire.vision.encoder), or None.
    images: object | None = None

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def pages(self) -> list[int]:
        """Its pages in the first pool: every page it has, where the engine's groups share one
        pool (what a connector moving pages by id works with)."""
        return self.tables[0]

    @pages.setter
    def pages(self, pages: list[int]) -> None:
        self.tables[0] = pages

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def in_decode(self) -> bool:
        """All tokens but the newest are cached: the next step feeds that one."""
        return self.phase is Phase.RUNNING and self.computed == len(self.tokens) - 1 and self.num_generated > 0


@dataclasses.dataclass
class Chunk:
    seq: Sequence
    start: int  # first position of the chunk
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == len(self.seq.tokens)


@dataclasses.dataclass
class Step:
    decode: list[Sequence]
    prefill: list[Chunk]
    preempted: list[Sequence]
    # Decode rows that verified drafts (jfire.speculative): how many tokens each emitted.
    emitted: dict[Sequence, int] = dataclasses.field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(
        self,
        pools: KVPools,
        *,
        max_batch: int,
        prefill_budget: int,
        max_prefill_rows: int,
        prefix_caching: bool = True,
        load_prefix: Callable[[list[bytes]], list[int]] | None = None,
    ):
        self.pools = pools
        self.page_size = pools.page_size
        # Leading blocks the device cache lacks, loaded from elsewhere (a host tier: its
        # KVConnector.load_prefix): the pages now holding them, registered and referenced.
        self.load_prefix = load_prefix
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self.max_prefill_rows = max_prefill_rows
        self.prefix_caching = prefix_caching
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order; the youngest is preempted first
        self.prefix_hit_tokens = 0
        self.prompt_tokens = 0
        self.preemptions = 0

    @classmethod
    def for_engine(cls, pools: KVPools, config, load_prefix=None) -> Scheduler:
        """The scheduler of an engine with these settings (an EngineConfig)."""
        return cls(
            pools,
            max_batch=config.max_batch,
            prefill_budget=config.prefill_budget,
            max_prefill_rows=config.max_prefill_rows,
            prefix_caching=config.prefix_caching,
            load_prefix=load_prefix,
        )

    # -- membership --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._fit_tables(seq)

    def _fit_tables(self, seq: Sequence) -> None:
        """One page list per pool (a sequence is made knowing nothing of the pools)."""
        while len(seq.tables) < len(self.pools.pools):
            seq.tables.append([])

    def add_running(self, seq: Sequence) -> None:
        """Admits a sequence whose prompt KV is already in its pages (moved from a prefill group)."""
        self._fit_tables(seq)
        seq.phase = Phase.RUNNING
        self.running.append(seq)
        self.prompt_tokens += len(seq.prompt_ids)

    def finish(self, seq: Sequence) -> None:
        """Ends a sequence (done, cancelled or failed) and frees its pages at once."""
        if seq.phase is Phase.RUNNING:
            self.running.remove(seq)
        elif seq.phase is Phase.WAITING:
            self.waiting.remove(seq)
        self.pools.free(seq.tables)
        seq.phase = Phase.FINISHED

    def pages_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> Step:
        preempted: list[Sequence] = []
        decode = self._schedule_decode(preempted)
        prefill = self._schedule_prefill(len(decode))
        return Step(decode, prefill, preempted)

    def _schedule_decode(self, preempted: list[Sequence]) -> list[Sequence]:
        decode = []
        for seq in list(self.running):
            if seq.phase is not Phase.RUNNING or not seq.in_decode or len(decode) == self.max_batch:
                continue
            while not self.pools.grow(seq.tables, len(seq.tokens)):
                victim = self._youngest_other_than(seq)
                if victim is None:  # the pool cannot hold even this one: admission prevents this
                    raise RuntimeError("KV pool exhausted by a single sequence")
                self._preempt(victim, preempted)
                if victim in decode:
                    decode.remove(victim)
            decode.append(seq)
        return decode

    def _schedule_prefill(self, num_decoding: int) -> list[Chunk]:
        budget, chunks = self.prefill_budget, []
        # Unfinished prompts first, in admission order.
        for seq in self.running:
            if budget == 0 or len(chunks) == self.max_prefill_rows:
                return chunks
            if not seq.in_decode and seq.computed < len(seq.tokens):
                chunk = self._chunk(seq, budget)
                if chunk is None:
                    return chunks
                chunks.append(chunk)
                budget -= chunk.length
        while self.waiting and budget > 0 and len(chunks) < self.max_prefill_rows:
            if len(self.running) >= self.max_batch:
                break
            seq = self.waiting[0]
            if not self._prefix_ready(seq.after):
                break
            self._attach_prefix(seq)
            chunk = self._chunk(seq, budget)
            if chunk is None:
                self.pools.free(seq.tables)  # give back the prefix pages; try again next step
                seq.computed = 0
                break
            self.waiting.popleft()
            seq.phase = Phase.RUNNING
            self.running.append(seq)
            self.prompt_tokens += len(seq.tokens)
            self.prefix_hit_tokens += seq.computed
            seq.prefix_hit_tokens = seq.computed
            chunks.append(chunk)
            budget -= chunk.length
        return chunks

    def _prefix_ready(self, first: Sequence | None) -> bool:
        if first is None or not self.prefix_caching or first.phase is Phase.FINISHED:
            return True
        return first.registered_blocks >= (len(first.prompt_ids) - 1) // self.page_size

    def _chunk(self, seq: Sequence, budget: int) -> Chunk | None:
        """The next chunk of seq's uncached tokens within budget, with pages for it (or None)."""
        length = min(len(seq.tokens) - seq.computed, budget)
        if not self.pools.grow(seq.tables, seq.computed + length):
            return None
        return Chunk(seq, seq.computed, length)

    def _attach_prefix(self, seq: Sequence) -> None:
        """Reuses cached pages for seq's leading full blocks, keeping at least one token to
        compute (its logits give the next token)."""
        if not self.prefix_caching or any(seq.tables) or seq.sampling.prompt_logprobs:  # those compute every token
            return
        reusable = (len(seq.tokens) - 1) // self.page_size
        hashes = _block_hashes(seq, reusable, self.page_size)
        seq.tables, blocks = self.pools.cached_prefix(hashes)
        if self.load_prefix is not None and blocks < len(hashes):
            # A connector loading blocks by id works with one shared pool (KVPools.shared).
            seq.pages += self.load_prefix(hashes[blocks:])
            blocks = len(seq.pages)
        seq.computed = blocks * self.page_size
        seq.registered_blocks = blocks

    def register_computed_blocks(self, seq: Sequence) -> None:
        """After a chunk ran: make seq's newly completed prompt blocks findable by later prompts."""
        if not self.prefix_caching:
            return
        full = min(seq.computed, len(seq.prompt_ids)) // self.page_size
        if full <= seq.registered_blocks:
            return
        hashes = _block_hashes(seq, full, self.page_size)
        self.pools.register(seq.tables, seq.registered_blocks, hashes)
        seq.registered_blocks = full

    def _youngest_other_than(self, seq: Sequence) -> Sequence | None:
        for other in reversed(self.running):
            if other is not seq:
                return other
        return None

    def _preempt(self, victim: Sequence, preempted: list[Sequence]) -> None:
        """Frees the victim's pages and queues it first in line to recompute what it had."""
        self.running.remove(victim)
        self.pools.free(victim.tables)
        victim.computed, victim.registered_blocks = 0, 0
        victim.phase = Phase.WAITING
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        preempted.append(victim)

    def rows_ahead(self, rows: list[Sequence | None], max_model_len: int) -> list[Sequence | None] | None:
        """For running ahead (the engine dispatches a decode step before reading the ids of the
        one in flight): the rows of the step after `rows`, in the same places (a row that the
        step in flight surely ends, by its length, becomes padding), each with pages for one
        more token. None where that step cannot be dispatched before the ids are read: a row's
        next token needs a mask built from this one (a grammar, min_tokens), no row goes on, or
        the pool has no page for a row's next token (the next normal step preempts as it must)."""
        following: list[Sequence | None] = []
        for seq in rows:
            going_on = (
                seq is not None
                and seq.phase is Phase.RUNNING
                and seq.num_generated + 1 < seq.sampling.max_tokens
                and len(seq.tokens) + 1 < max_model_len
            )
            if (
                seq is not None
                and going_on
                and (seq.matcher is not None or seq.num_generated + 1 < seq.sampling.min_tokens)
            ):
                return None
            following.append(seq if going_on else None)
        if not any(following):
            return None
        for seq in filter(None, following):
            if not self.pools.grow(seq.tables, len(seq.tokens) + 1):
                return None
        return following

    def stats(self) -> dict:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            **self.pools.stats(),
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "preemptions": self.preemptions,
            "prompt_tokens": self.prompt_tokens,
        }

    def on_step_done(self, step: Step) -> None:
        """Advances the computed counts after the programs ran (before new tokens are appended)."""
        for seq in step.decode:
            emitted = step.emitted.get(seq)
            seq.computed += emitted or 1
            if emitted is not None:  # its pages past the emitted tokens held rejected drafts
                self.pools.shrink(seq.tables, seq.computed + 1)
            self.pools.release_behind(seq.tables, seq.computed)
        for chunk in step.prefill:
            chunk.seq.computed += chunk.length
            self.register_computed_blocks(chunk.seq)
            self.pools.release_behind(chunk.seq.tables, chunk.seq.computed)


def _image_keys(seq: Sequence):
    """What a block of seq's holds besides its ids: the hashes of the images with rows in it."""
    return seq.images.extra_keys if seq.images is not None else None  # type: ignore[attr-defined]


def _block_hashes(seq: Sequence, blocks: int, page_size: int) -> list[bytes]:
    """The hashes of seq's first `blocks` blocks, seeded with its cache salt (a prompt finds only
    blocks of prompts with the same salt)."""
    return block_hashes(
        seq.tokens[: blocks * page_size], page_size, salt=seq.sampling.cache_salt, extra_keys=_image_keys(seq)
    )
