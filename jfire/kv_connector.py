"""KV connectors: where an engine's KV cache comes from and goes to besides its own programs.

An engine runs with one connector. The base class, `KVConnector`, is the colocated engine's:
every prompt is computed here and no KV leaves. The split roles of a disaggregated deployment
are connectors (jfire.disagg.connectors: the prefill role saves a finished prompt's pages for
another engine to load; the decode role loads them), and so is the in-process pair tests use
(jfire.disagg.in_process). The next tiers (a host-memory tier, a shared prefix store) plug in
at the same hooks.

The connector has two sides, as vLLM's KVConnectorBase_V1 does:
- Scheduler side, called on the engine thread: `check` a request as this role takes it;
  `update` once per loop turn, which makes progress on loads and saves (asynchronous: pulls
  run on other threads) and hands back the requests whose KV has arrived or failed;
  `request_finished` when a prompt is done, in a role that ends requests there (it keeps the
  pages and returns what the loading side needs); `cancel`, `held_requests`, stats.
- Worker side, run on every process of a group: device calls (gather pages to send, insert
  pages that arrived) added to the runner with `ModelRunner.add_calls` in `bind`, so a
  group's followers replay them like the model's programs.

A connector reaches the engine only through its public parts: `engine.pool` (the BlockPool),
`engine.runner` (pages, calls), `engine.scheduler`, `engine.config`, `engine.model`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jfire.errors import JfireError
from jfire.sampling import SamplingParams

if TYPE_CHECKING:
    from jfire.outputs import LiveRequest
    from jfire.scheduler import Sequence


@dataclasses.dataclass
class Loaded:
    """A request whose prompt's KV arrived in `live.seq.pages`: it joins the batch with its
    first token (sampled where the prompt ran)."""

    live: LiveRequest
    first_token: int
    first_logprobs: list | None = None


@dataclasses.dataclass
class Failed:
    """A request the connector held that ends without joining the batch: cancelled (error
    None) or failed (the error says why). Its pages are already back in the pool."""

    live: LiveRequest
    error: str | None


@dataclasses.dataclass
class Progress:
    loaded: list[Loaded] = dataclasses.field(default_factory=list)
    failed: list[Failed] = dataclasses.field(default_factory=list)


def prompt_only(request_id: str | None, sampling: SamplingParams) -> SamplingParams:
    """A prefill role's check: it needs the request's id (the decode side finds the request by
    it) and runs only the prompt, so the engine checks the request as one token to generate."""
    if request_id is None:
        raise JfireError("a prefill request needs its request id")
    return dataclasses.replace(sampling, max_tokens=1, stop=())


def check_prefilled(request_id: str | None, kv_params, sampling: SamplingParams) -> None:
    """A decode role's check: a prefilled request brings its id, first token and transfer,
    and the seed its prefill sampled with."""
    if request_id is None or not kv_params or "transfer" not in kv_params or "first_token" not in kv_params:
        raise JfireError("a decode group takes prefilled requests: their id, first token and KV transfer")
    if sampling.seed is None:
        raise JfireError("a prefilled request needs the seed its prefill sampled with")


class KVConnector:
    """The colocated engine's connector: every hook leaves the engine as it is."""

    role = "colocated"
    program_kinds: tuple[str, ...] = ("prefill", "decode")  # the model programs this role runs
    # Whether a request ends once its prompt is computed (its first token sampled): the
    # prefill role's, whose requests are finished by another engine.
    ends_after_prompt = False
    # Whether it reads or writes pages by page id across every cache array (a KV transfer, a
    # host tier): the engine then keeps one pool for all its cache groups, every page kept
    # (jfire.kv_cache.KVPools). Every connector but this do-nothing one does.
    pages_by_id = False

    def bind(self, engine) -> None:
        """Called once by the engine (jfire.engine.Engine) being built, before it compiles
        anything; `engine` is the connector's way to the engine's public parts."""
        self.engine = engine

    def side_programs(self) -> list:
        """Programs compiled at start-up besides the model's (a transfer's gather or insert)."""
        return []

    # -- scheduler side ------------------------------------------------------------------------

    def check(
        self, request_id: str | None, prompt_ids: list[int], sampling: SamplingParams, kv_params
    ) -> SamplingParams:
        """Raises JfireError for a request this role cannot take; returns the sampling the
        engine's request check applies to (what of the request runs here)."""
        if kv_params is not None:
            raise ValueError("this engine takes no KV from elsewhere; send the request without kv_params")
        return sampling

    def loads(self, live: LiveRequest) -> bool:
        """Whether the request's prompt KV comes from elsewhere: the connector holds it
        (`hold`) until `update` reports it loaded or failed."""
        return False

    def hold(self, live: LiveRequest) -> None:
        raise NotImplementedError

    def update(self) -> Progress:
        """Progress on loads and saves, once per loop turn before scheduling."""
        return Progress()

    def load_prefix(self, hashes: list[bytes]) -> list[int]:
        """The scheduler admits a request whose leading blocks `hashes` (chained block hashes,
        jfire.kv_cache.block_hashes) the device cache lacks: pages now holding the longest run
        of them loaded from elsewhere, each registered in the pool and referenced once (as
        `BlockPool.lookup_prefix` gives them), before any program reads them."""
        return []

    def request_finished(self, seq: Sequence, kv_params: dict | None) -> dict:
        """With `ends_after_prompt`: the prompt of `seq` is computed; keep its pages for the
        loading side and return what it needs to load them (the request's transfer)."""
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        """Cancels a request the connector holds (one not running): `update` ends it."""

    def held_requests(self) -> list[LiveRequest]:
        """Takes every request the connector holds (the engine fails them all)."""
        return []

    def has_pending(self) -> bool:
        """Whether work waits for the loop (a step in between would take it in)."""
        return False

    def poll_interval(self) -> float | None:
        """How soon an idle engine's loop must turn again for this connector (None: no need)."""
        return None

    def stats(self) -> dict:
        """Counts added to the engine's stats on every step (cheap: read on the engine thread)."""
        return {}

    def num_waiting(self) -> int:
        """Requests held waiting to be admitted: counted as waiting in the engine's stats."""
        return 0

    def stats_now(self) -> dict:
        """Figures read when stats are asked for (may read a store)."""
        return {}

    def shutdown(self) -> None:
        """After the engine's thread has stopped."""


class ConnectorStack(KVConnector):
    """A role's connector with tiers beside it (a prefill group with a host-memory tier): the
    first connector is the role (program kinds, which requests end after their prompt, what
    `request_finished` publishes); every hook of the others runs too, and a prefix the device
    lacks is asked of each in turn."""

    def __init__(self, role: KVConnector, *tiers: KVConnector):
        self.parts = (role, *tiers)
        self.role, self.program_kinds, self.ends_after_prompt = role.role, role.program_kinds, role.ends_after_prompt
        self.pages_by_id = any(part.pages_by_id for part in self.parts)

    def bind(self, engine) -> None:
        super().bind(engine)
        for part in self.parts:
            part.bind(engine)

    def side_programs(self) -> list:
        return [p for part in self.parts for p in part.side_programs()]

    def check(self, request_id, prompt_ids, sampling: SamplingParams, kv_params) -> SamplingParams:
        checked = self.parts[0].check(request_id, prompt_ids, sampling, kv_params)
        for part in self.parts[1:]:
            checked = part.check(request_id, prompt_ids, checked, None)
        return checked

    def loads(self, live: LiveRequest) -> bool:
        return any(part.loads(live) for part in self.parts)

    def hold(self, live: LiveRequest) -> None:
        next(part for part in self.parts if part.loads(live)).hold(live)

    def update(self) -> Progress:
        progress = Progress()
        for part in self.parts:
            done = part.update()
            progress.loaded += done.loaded
            progress.failed += done.failed
        return progress

    def load_prefix(self, hashes: list[bytes]) -> list[int]:
        pages: list[int] = []
        for part in self.parts:
            if len(pages) < len(hashes):
                pages += part.load_prefix(hashes[len(pages) :])
        return pages

    def request_finished(self, seq: Sequence, kv_params: dict | None) -> dict:
        return self.parts[0].request_finished(seq, kv_params)

    def cancel(self, request_id: str) -> None:
        for part in self.parts:
            part.cancel(request_id)

    def held_requests(self) -> list[LiveRequest]:
        return [live for part in self.parts for live in part.held_requests()]

    def has_pending(self) -> bool:
        return any(part.has_pending() for part in self.parts)

    def poll_interval(self) -> float | None:
        intervals = [i for i in (part.poll_interval() for part in self.parts) if i is not None]
        return min(intervals) if intervals else None

    def stats(self) -> dict:
        return {k: v for part in self.parts for k, v in part.stats().items()}

    def num_waiting(self) -> int:
        return sum(part.num_waiting() for part in self.parts)

    def stats_now(self) -> dict:
        return {k: v for part in self.parts for k, v in part.stats_now().items()}

    def shutdown(self) -> None:
        for part in self.parts:
            part.shutdown()
