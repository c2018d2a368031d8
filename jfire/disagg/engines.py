"""The engine in its two split roles.

`PrefillEngine` runs only prefill programs. When a prompt is done it samples the first token,
gathers the request's pages into wire arrays, publishes them on the transfer server and ends
the request with finish_reason "prefilled" and where to pull from. Its pages stay referenced
until the decode side acknowledges (a key in the cluster store) or the transfer times out.

`DecodeEngine` runs only decode programs. A prefilled request waits until the pool has pages
for all of it (prompt + max_tokens, so a decode group never needs to preempt, which would
mean recomputing a prompt it has no program for), then its KV is pulled straight into those
pages, acknowledged, and it joins the running batch with its first token.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import time

import jax

from jfire.disagg import blocks, cluster
from jfire.disagg.kv_transfer import KVLayout, Pull, Puller, TransferPrograms, new_uuid, placeholder, transfer_widths
from jfire.engine import Engine, RequestHandle, RequestOutput, _Live
from jfire.errors import JfireError
from jfire.sampling import SamplingParams
from jfire.scheduler import Phase, Sequence

ACK_POLL_S = 0.01
CONTROL_POLL_S = 0.2  # how often a prefill group reads renewals and pulls a decode group gave up on


def _layout(engine: Engine) -> KVLayout:
    return KVLayout(
        engine.cfg,
        engine.model.kv_replication,
        engine.config.page_size,
        engine.model.dtype_of_params,
        engine.model.mesh,
    )


def _transfer_programs(engine: Engine, kind: str) -> TransferPrograms:
    widths = transfer_widths(engine.buckets.pages_per_row, engine.config.page_size)
    return TransferPrograms(engine.layout, engine.pages, widths, kind)


@dataclasses.dataclass
class _Published:
    pages: list[int]
    arrays: list  # kept alive until acknowledged: the transfer server reads them when pulled
    structs: list
    deadline: float


class PrefillEngine(Engine):
    PROGRAM_KINDS = ("prefill",)
    CALL_KINDS = Engine.CALL_KINDS + ("publish", "release")

    def __init__(self, model, config, *, server, store, group: str, transfer_timeout_s: float):
        super().__init__(model, config)
        self.layout = _layout(self)
        self.gather = _transfer_programs(self, "gather")
        self.server, self.store, self.group = server, store, group
        self.puller = Puller(server)  # drains only: pulls of our own transfers nobody took
        self.transfer_timeout_s = transfer_timeout_s
        self.transfer_addresses: dict[str, str] = {}  # a group spanning processes: process -> its transfer server
        self._shards: dict[str, int] = {}  # request id -> the wire split its decode group asked for
        self._receivers: dict[str, dict] = {}  # request id -> its decode group's layout (jfire.disagg.blocks)
        self._sent: dict[int, list] = {}  # blocks this process published, per transfer, until released
        self.sent_bytes = 0  # KV bytes this process published
        self._published: dict[int, _Published] = {}
        self._placeholders: dict[int, tuple[list, float]] = {}  # uuid -> (zeros published, when to drop them)
        self._last_ack_poll = self._last_control_poll = 0.0
        self.transfer_counts = collections.Counter()

    def side_programs(self) -> list:
        return [self.gather]

    def shutdown(self) -> None:
        super().shutdown()
        self.puller.shutdown()

    def validate(self, prompt_ids, sampling: SamplingParams) -> None:
        # Only the prompt runs here; the decode group checks the whole request.
        super().validate(prompt_ids, dataclasses.replace(sampling, max_tokens=1, stop=()))

    def submit(
        self,
        prompt_ids,
        sampling,
        *,
        request_id=None,
        on_output=None,
        affinity=None,
        shards: int = 1,
        receiver: dict | None = None,
    ) -> RequestHandle:
        if request_id is None:
            raise JfireError("a prefill request needs its request id")
        self._shards[request_id] = shards
        if receiver is not None:
            self._receivers[request_id] = receiver
        try:
            return super().submit(prompt_ids, sampling, request_id=request_id, on_output=on_output)
        except Exception:  # refused: nothing of it may stay behind
            self._shards.pop(request_id, None)
            self._receivers.pop(request_id, None)
            raise

    def _append(self, live: _Live, token: int, logprobs: list | None = None) -> None:
        """The prompt is done: publish its KV and end the request here with the first token
        (the decode group checks it against the grammar, adds it to its penalty counts and
        detokenizes it)."""
        seq = live.seq
        pages = seq.pages[: self.scheduler.pages_needed(len(seq.prompt_ids))]
        self.pool.retain(pages)
        shards = self.layout.usable_shards(self._shards.pop(seq.request_id, 1))
        receiver = self._receivers.pop(seq.request_id, None)
        uuid = new_uuid()
        transfer = {
            "uuid": uuid,
            "num_pages": len(pages),
            "group": self.group,
            "pages": pages,
            "bytes": len(pages) * self.layout.page_nbytes,
        }
        deadline = time.monotonic() + self.transfer_timeout_s
        if receiver is not None:  # groups spanning processes: every process sends its own blocks
            transfer.update(
                protocol="blocks",
                sender=blocks.describe(self.layout),
                addresses=self.transfer_addresses,
                checksum=self._device_call("publish", uuid, (pages, receiver)),
            )
            self._published[uuid] = _Published(pages, None, None, deadline)
        else:
            gathered, sent_checksum = self.gather.gather(self.pages, pages)
            arrays = self.layout.to_wire(gathered, shards)
            self.server.await_pull(uuid, arrays)
            self._published[uuid] = _Published(pages, arrays, self.layout.wire_structs(len(pages), shards), deadline)
            transfer.update(address=self.server.address(), shards=shards, checksum=sent_checksum)
        self.transfer_counts["published"] += 1
        self._tokens_generated += 1
        out = RequestOutput(
            seq.request_id,
            [token],
            "",
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=1,
            prefix_hit_tokens=seq.prefix_hit_tokens,
            transfer=transfer,
            logprobs=[logprobs] if logprobs is not None else None,
            prompt_logprobs=self._prompt_logprobs_once(live),
        )
        self._finish(live, "prefilled", last=out)

    def _finish(self, live, reason, *, last=None, error=None):
        self._shards.pop(live.seq.request_id, None)
        self._receivers.pop(live.seq.request_id, None)
        super()._finish(live, reason, last=last, error=error)

    def _apply(self, kind, key, inputs):
        """Also, on every process of the group: "publish" (gather a request's pages and send
        this process's blocks of them, keyed by the transfer's uuid; returns the checksum) and
        "release" (drop them; inputs True: also take them off the transfer server)."""
        if kind == "publish":
            pages, receiver = inputs
            gathered, sent_checksum = self.gather.gather(self.pages, pages)
            plan, me = blocks.BlockPlan(self.layout, blocks.describe(self.layout), receiver), jax.process_index()
            sent = []
            for _, q in sorted(pair for pair in plan.pairs() if pair[0] == me):
                uuid, pieces = blocks.pair_uuid(key, me, q), blocks.pieces_to_send(plan, gathered, q)
                self.server.await_pull(uuid, pieces)
                sent.append((uuid, pieces))
                self.sent_bytes += sum(x.nbytes for x in pieces)
            self._sent[key] = sent
            blocks.report_bytes(self.store, self.group, self.sent_bytes)
            return sent_checksum
        if kind == "release":
            for uuid, pieces in self._sent.pop(key, []):
                if inputs:
                    self.puller.drain(
                        uuid,
                        [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in pieces],
                        self.transfer_timeout_s,
                    )
            return None
        return super()._apply(kind, key, inputs)

    def _idle_wait(self):
        return 0.02 if (self._published and not self._live) else super()._idle_wait()

    def _between_steps(self) -> None:
        now = time.monotonic()
        if now - self._last_control_poll >= CONTROL_POLL_S:
            self._last_control_poll = now
            self._answer_abandoned_pulls(now)
            self._renew(now)
        if not self._published:
            return
        if now - self._last_ack_poll >= ACK_POLL_S:
            self._last_ack_poll = now
            for uuid, value in cluster.take_all(self.store, cluster.ack_key(self.group, "")):
                if uuid in self._published:
                    # Nobody will pull a dropped one: take it off the transfer server too.
                    self._release(uuid, drain_it=value == cluster.DROPPED)
                    self.transfer_counts["dropped" if value == cluster.DROPPED else "acknowledged"] += 1
        for uuid, published in list(self._published.items()):
            if now > published.deadline:
                self._release(uuid, drain_it=True)
                self.transfer_counts["expired"] += 1

    def _release(self, uuid: int, drain_it: bool = False) -> None:
        published = self._published.pop(uuid)
        self.pool.free(published.pages)
        if published.structs is None:  # sent in blocks, by every process of the group
            self._device_call("release", uuid, drain_it)
        elif drain_it:
            self.puller.drain(uuid, published.structs, self.transfer_timeout_s)

    def _renew(self, now: float) -> None:
        """A decode group still waiting for pages for a request wants its cache kept."""
        for uuid, _ in cluster.take_all(self.store, cluster.renew_key(self.group, "")):
            if uuid in self._published:
                self._published[uuid].deadline = now + self.transfer_timeout_s
                self.transfer_counts["renewed"] += 1

    def _answer_abandoned_pulls(self, now: float) -> None:
        """A decode group gave up on a pull still blocked on an id published here never or no
        longer (expired first): zeros published under that id end its pull. An id still
        published needs nothing: the pull is served from it."""
        for uuid, value in cluster.take_all(self.store, cluster.abandon_key(self.group, "")):
            if uuid in self._published or uuid in self._placeholders:
                continue
            shape = json.loads(value)
            zeros = placeholder(self.layout, int(shape["num_pages"]), int(shape["shards"]))
            self.server.await_pull(uuid, zeros)
            # Kept alive while the pull takes them; dropped after a timeout in case it never
            # comes (the pull ended on its own between giving up and this answer).
            self._placeholders[uuid] = (zeros, now + self.transfer_timeout_s)
            self.transfer_counts["abandoned"] += 1
        for uuid, (_, drop_at) in list(self._placeholders.items()):
            if now > drop_at:
                del self._placeholders[uuid]

    def stats(self) -> dict:
        # Per process of a group spanning processes: the KV bytes each has sent in blocks.
        return {**super().stats(), "kv_bytes_sent_by_process": blocks.read_bytes(self.store, self.group)}

    def _publish_stats(self) -> None:
        super()._publish_stats()
        self._stats = {
            **self._stats,
            "transfers_pending": len(self._published),
            "transfers_published": self.transfer_counts["published"],
            "transfers_acknowledged": self.transfer_counts["acknowledged"],
            "transfers_expired": self.transfer_counts["expired"],
            "transfers_dropped": self.transfer_counts["dropped"],
            "transfers_renewed": self.transfer_counts["renewed"],
            "pulls_abandoned": self.transfer_counts["abandoned"],
            "compiled_programs": self.programs.num_compiled + self.gather.num_compiled,
        }


@dataclasses.dataclass(eq=False)
class _Incoming:
    """A prefilled request on its way into the decode group."""

    live: _Live
    first_token: int
    transfer: dict
    first_logprobs: list | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    pull: Pull | None = None
    cancelled: bool = False
    renewed_at: float = dataclasses.field(
        default_factory=time.monotonic
    )  # when the prefill group last heard it is wanted


class DecodeEngine(Engine):
    PROGRAM_KINDS = ("decode",)
    CALL_KINDS = Engine.CALL_KINDS + ("pull", "insert", "forget")

    def __init__(self, model, config, *, server, store, transfer_timeout_s: float, group: str = "decode"):
        super().__init__(model, config)
        self.layout = _layout(self)
        self.insert = _transfer_programs(self, "insert")
        self.server, self.store, self.group = server, store, group
        self.puller = Puller(server)
        self._block_pulls: dict[int, blocks.BlockPulls] = {}  # this process's pulls, per transfer uuid
        self.pulled_bytes = 0  # KV bytes this process pulled (blocks of a group spanning processes)
        self.transfer_timeout_s = transfer_timeout_s
        self._admitting: collections.deque[_Incoming] = collections.deque()  # waiting for pages
        self._pulling: dict[str, _Incoming] = {}
        self.kv_transfer_bytes = 0
        self.transfer_counts = collections.Counter()

    def side_programs(self) -> list:
        return [self.insert]

    def shutdown(self) -> None:
        super().shutdown()
        self.puller.shutdown()

    def _apply(self, kind, key, inputs):
        """Also, on every process of the group, for a transfer sent in blocks: "pull" (start
        this process's pulls), "insert" (wait for them and write the pages; returns the
        checksum of what arrived) and "forget" (drop them)."""
        if kind == "pull":
            self._block_pulls[key] = blocks.BlockPulls(self.puller, self.layout, inputs, self.transfer_timeout_s)
            return None
        if kind == "insert":
            pulls = self._block_pulls.pop(key)
            pulls.wait()
            arrays, nbytes = pulls.arrays()
            self.pages, arrived = self.insert.insert(self.pages, arrays, inputs)
            self.pulled_bytes += nbytes
            blocks.report_bytes(self.store, self.group, self.pulled_bytes)
            return arrived
        if kind == "forget":
            self._block_pulls.pop(key, None)
            return None
        return super()._apply(kind, key, inputs)

    def submit_prefilled(
        self,
        prompt_ids: list[int],
        first_token: int,
        sampling: SamplingParams,
        transfer: dict,
        *,
        request_id: str,
        on_output,
        first_logprobs: list | None = None,
    ) -> RequestHandle:
        """Queues a request whose prompt a prefill group has run; it is admitted when the pool
        has pages for all of it, and its KV is pulled from `transfer` then."""
        if self.error is not None:
            raise JfireError(f"the engine has stopped after an error: {self.error}")
        prompt_ids = [int(i) for i in prompt_ids]
        self.validate(prompt_ids, sampling)
        expected = self.scheduler.pages_needed(len(prompt_ids))
        if transfer.get("num_pages") != expected:
            raise JfireError(
                f"the transfer has {transfer.get('num_pages')} pages but a {len(prompt_ids)}-token "
                f"prompt fills {expected} pages of {self.config.page_size} tokens"
            )
        if sampling.seed is None:
            raise JfireError("a prefilled request needs the seed its prefill sampled with")
        handle = RequestHandle(self, request_id, prompt_ids, self.model.tokenizer is not None)
        seq = Sequence(request_id, prompt_ids, sampling, sampling.seed)
        live = self._new_live(seq, handle, on_output or handle.outputs.put)
        self._commands.put(("prefilled", _Incoming(live, int(first_token), transfer, first_logprobs)))
        return handle

    def _command(self, kind, arg) -> None:
        if kind == "prefilled":
            self._admitting.append(arg)
        elif kind == "cancel" and arg not in self._live:
            for incoming in [*self._admitting, *self._pulling.values()]:
                if incoming.live.seq.request_id == arg:
                    incoming.cancelled = True
        else:
            super()._command(kind, arg)

    def _all_requests(self):
        incoming = [*self._admitting, *self._pulling.values()]
        for i in incoming:
            i.live.seq.phase = Phase.FINISHED  # never in the scheduler: nothing to remove there
        return super()._all_requests() + [i.live for i in incoming]

    def _idle_wait(self):
        if self._live:
            return None
        return 0.002 if (self._pulling or self._admitting) else 0.5

    def _work_pending(self) -> bool:
        return super()._work_pending() or bool(self._admitting) or bool(self._pulling)

    def _between_steps(self) -> None:
        self._admit()
        self._keep_waiting_caches()
        for request_id, incoming in list(self._pulling.items()):
            if incoming.pull.done:
                del self._pulling[request_id]
                self._arrive(incoming)
            elif incoming.pull.expired:
                del self._pulling[request_id]
                t = incoming.transfer
                if t.get("protocol") == "blocks":
                    self._device_call("forget", t["uuid"], None)
                # The pull is still blocked: the sender ends it (see kv_transfer.Pull).
                self.store.key_value_set(
                    cluster.abandon_key(t["group"], t["uuid"]),
                    json.dumps({"num_pages": t["num_pages"], "shards": t["shards"]}),
                )
                self._fail(
                    incoming,
                    f"the KV cache from prefill group {incoming.transfer.get('group')!r} did not "
                    f"arrive within {self.transfer_timeout_s:g} s; the request was dropped",
                )

    def _admit(self) -> None:
        """Starts pulls in arrival order while batch slots and pages for whole requests last."""
        while self._admitting:
            incoming = self._admitting[0]
            if incoming.cancelled:
                self._admitting.popleft()
                self._fail(incoming, None)
                continue
            if len(self.scheduler.running) + len(self._pulling) >= self.config.max_batch:
                return
            seq = incoming.live.seq
            pages = self.pool.allocate(self.scheduler.pages_needed(len(seq.prompt_ids) + seq.sampling.max_tokens))
            if pages is None:
                return
            self._admitting.popleft()
            incoming.pages = pages
            t = incoming.transfer
            if t.get("protocol") == "blocks":
                self._device_call("pull", t["uuid"], t)
                incoming.pull = self._block_pulls[t["uuid"]]
            else:
                structs = self.layout.wire_structs(t["num_pages"], t["shards"])
                incoming.pull = self.puller.pull(t["address"], t["uuid"], structs, self.transfer_timeout_s)
            self._pulling[seq.request_id] = incoming

    def _keep_waiting_caches(self) -> None:
        """Requests waiting here for pages (the pool is full) ask their prefill group, three
        times per timeout, to keep their KV cache: the wait may outlast the timeout, and the
        prefill group holding pages meanwhile is the backpressure that should be."""
        now = time.monotonic()
        for incoming in self._admitting:
            if now - incoming.renewed_at >= self.transfer_timeout_s / 3 and not incoming.cancelled:
                t = incoming.transfer
                self.store.key_value_set(cluster.renew_key(t["group"], t["uuid"]), "1", allow_overwrite=True)
                incoming.renewed_at = now

    def _arrive(self, incoming: _Incoming) -> None:
        t, seq = incoming.transfer, incoming.live.seq
        if incoming.pull.error is not None:
            if t.get("protocol") == "blocks":
                self._device_call("forget", t["uuid"], None)
            self._fail(
                incoming, f"pulling the KV cache from prefill group {t.get('group')!r} failed: {incoming.pull.error}"
            )
            return
        if t.get("protocol") == "blocks":
            self._arrive_in_blocks(incoming)
            return
        # Acknowledge at once: the prefill group frees its pages as soon as it reads this.
        self.store.key_value_set(cluster.ack_key(t["group"], t["uuid"]), cluster.PULLED)
        if incoming.cancelled:
            self._fail(incoming, None)
            return
        arrays = incoming.pull.arrays
        self.pages, arrived_checksum = self.insert.insert(self.pages, arrays, incoming.pages[: t["num_pages"]])
        if "checksum" in t and arrived_checksum != t["checksum"]:
            self._corrupted(incoming, arrived_checksum)
            return
        self.kv_transfer_bytes += sum(a.nbytes for a in arrays)
        self.transfer_counts["pulled"] += 1
        seq.pages, seq.computed = incoming.pages, len(seq.prompt_ids)
        self.scheduler.add_running(seq)
        self._live[seq.request_id] = incoming.live
        self._append(incoming.live, incoming.first_token, incoming.first_logprobs)

    def _arrive_in_blocks(self, incoming: _Incoming) -> None:
        """Every process of the group writes its blocks (followers wait for their own pulls);
        the checksum, a sum over all of them, is read once they all have, then acknowledged."""
        t, seq = incoming.transfer, incoming.live.seq
        if incoming.cancelled:  # pulled, so acknowledged as such (a drain would find nothing to take)
            self._device_call("forget", t["uuid"], None)
            self.store.key_value_set(cluster.ack_key(t["group"], t["uuid"]), cluster.PULLED)
            self._fail(incoming, None)
            return
        arrived = self._device_call("insert", t["uuid"], incoming.pages[: t["num_pages"]])
        self.store.key_value_set(cluster.ack_key(t["group"], t["uuid"]), cluster.PULLED)
        if arrived != t["checksum"]:
            self._corrupted(incoming, arrived)
            return
        self.kv_transfer_bytes += t["bytes"]
        self.transfer_counts["pulled"] += 1
        seq.pages, seq.computed = incoming.pages, len(seq.prompt_ids)
        self.scheduler.add_running(seq)
        self._live[seq.request_id] = incoming.live
        self._append(incoming.live, incoming.first_token, incoming.first_logprobs)

    def _corrupted(self, incoming: _Incoming, arrived: int) -> None:
        """A transfer whose bytes differ from those sent: a sender killed mid-transfer can cause
        it, nothing else should. Counted, logged with what it involved, and the request failed."""
        t, seq = incoming.transfer, incoming.live.seq
        self.transfer_counts["corrupted"] += 1
        print(
            f"jfire: {self.group}: the KV cache of request {seq.request_id} (transfer {t['uuid']}) from prefill "
            f"group {t.get('group')!r} arrived with other bytes than were sent: checksum {arrived:#010x}, sent "
            f"{t['checksum']:#010x}; {t['num_pages']} pages, prefill pages {t.get('pages')}, decode pages "
            f"{incoming.pages[: t['num_pages']]}",
            file=sys.stderr,
            flush=True,
        )
        self._fail(
            incoming,
            f"the KV cache from prefill group {t.get('group')!r} arrived with other bytes than were "
            f"sent (checksum {arrived:#010x}, sent {t['checksum']:#010x}): a process stopped "
            "mid-transfer, or a fault in the transfer (logged by the decode group); the request "
            "was dropped",
        )

    def _fail(self, incoming: _Incoming, error: str | None) -> None:
        """Ends a request that never joined the batch: cancelled (error None) or failed."""
        if incoming.pull is None:  # never pulled: the prefill group frees its cache now, not at its timeout
            t = incoming.transfer
            self.store.key_value_set(cluster.ack_key(t["group"], t["uuid"]), cluster.DROPPED, allow_overwrite=True)
        self.pool.free(incoming.pages)
        incoming.pages = []
        incoming.live.seq.phase = Phase.FINISHED
        if error is not None:
            self.transfer_counts["failed"] += 1
        self._finish(incoming.live, "cancelled" if error is None else "error", error=error)

    def stats(self) -> dict:
        # Per process of a group spanning processes: the KV bytes each has pulled in blocks.
        return {**super().stats(), "kv_bytes_pulled_by_process": blocks.read_bytes(self.store, self.group)}

    def _publish_stats(self) -> None:
        super()._publish_stats()
        self._stats = {
            **self._stats,
            "waiting": self._stats["waiting"] + len(self._admitting),
            "transferring": len(self._pulling),
            "kv_transfer_bytes": self.kv_transfer_bytes,
            "kv_transfers": self.transfer_counts["pulled"],
            "transfers_failed": self.transfer_counts["failed"],
            "transfers_corrupted": self.transfer_counts["corrupted"],
            "pull_threads": self.puller.in_flight,
            "compiled_programs": self.programs.num_compiled + self.insert.num_compiled,
        }
