"""The two roles of a split deployment, as KV connectors over JAX's transfer server.

`PrefillConnector`: the engine runs only prefill programs. When a prompt is done it samples
the first token; the connector gathers the request's pages into wire arrays, publishes them
on the transfer server, and the request ends with finish_reason "prefilled" and where to pull
from. Its pages stay referenced until the decode side acknowledges (a key in the cluster
store) or the transfer times out.

`DecodeConnector`: the engine runs only decode programs. A prefilled request waits until the
pool has pages for all of it (prompt + max_tokens, so a decode group never needs to preempt,
which would mean recomputing a prompt it has no program for), then its KV is pulled straight
into those pages, acknowledged, and it joins the running batch with its first token.

With `compress` (a deployment's `[transfer] compress`) the pages travel coded
(jfire.disagg.kv_codec), decoded by the decode group's insert program.

A group spanning processes sends and pulls in blocks (jfire.disagg.blocks): each process its
own share, through device calls every process of the group runs ("publish", "release";
"pull", "insert", "forget").

What a decode group is told of a transfer is checked before the request reaches the engine
thread (`DecodeConnector.check`, at submit): the descriptor must be signed with the
deployment secret, name one of the deployment's prefill groups, and fit this group's layout;
its id is taken once; and the pages' keyed sum must match on arrival (jfire.disagg.transfer_auth).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import time

import jax

from jfire.deployment_secret import DeploymentSecret
from jfire.disagg import blocks, cluster
from jfire.disagg.kv_transfer import (
    CODEC,
    KVLayout,
    Pull,
    Puller,
    kv_layout,
    new_uuid,
    placeholder,
    transfer_programs,
)
from jfire.disagg.transfer_auth import (
    RecentIds,
    TransferKey,
    check_fields,
    new_transfer_id,
    sign_transfer,
    signed_by_deployment,
)
from jfire.errors import JfireError
from jfire.kv_connector import Failed, KVConnector, Loaded, Progress, check_prefilled, prompt_only
from jfire.outputs import LiveRequest
from jfire.sampling import SamplingParams
from jfire.scheduler import Phase, Sequence

ACK_POLL_S = 0.01
CONTROL_POLL_S = 0.2  # how often a prefill group reads renewals and pulls a decode group gave up on


@dataclasses.dataclass
class _Published:
    pages: list[int]
    arrays: list | None  # kept alive until acknowledged: the transfer server reads them when pulled
    structs: list | None
    deadline: float


class PrefillConnector(KVConnector):
    role = "prefill"
    program_kinds = ("prefill",)
    pages_by_id = True
    ends_after_prompt = True

    def __init__(
        self,
        *,
        server,
        store,
        group: str,
        transfer_timeout_s: float,
        secret: DeploymentSecret,
        compress: bool = False,
    ):
        self.server, self.store, self.group = server, store, group
        self.secret = secret  # signs each transfer's descriptor and keys its page sums
        self.compress = compress
        self.puller = Puller(server)  # drains only: pulls of our own transfers nobody took
        self.transfer_timeout_s = transfer_timeout_s
        self.transfer_addresses: dict[str, str] = {}  # a group spanning processes: process -> its transfer server
        self._sent: dict[int, list] = {}  # blocks this process published, per transfer, until released
        self.sent_bytes = 0  # KV bytes this process published
        self._published: dict[int, _Published] = {}
        self._placeholders: dict[int, tuple[list, float]] = {}  # uuid -> (zeros published, when to drop them)
        self._last_ack_poll = self._last_control_poll = 0.0
        self.transfer_counts: collections.Counter = collections.Counter()

    def bind(self, engine) -> None:
        super().bind(engine)
        self.pool, self.runner = engine.pool, engine.runner
        self.layout = kv_layout(engine)
        coded = _check_codable(self.layout, self.compress)
        self.gather = transfer_programs(engine, self.layout, "gather", coded=coded, keyed=True)
        self.runner.add_calls({"publish": self._publish_blocks, "release": self._release_blocks})

    def side_programs(self) -> list:
        return [self.gather]

    def shutdown(self) -> None:
        self.puller.shutdown()

    def check(self, request_id, prompt_ids, sampling: SamplingParams, kv_params) -> SamplingParams:
        return prompt_only(request_id, sampling)  # the decode group checks the whole request

    def request_finished(self, seq: Sequence, kv_params: dict | None) -> dict:
        """The prompt is done: publish its KV; the request ends here with the first token."""
        kv_params = kv_params or {}
        pages = seq.pages[: self.engine.scheduler.pages_needed(len(seq.prompt_ids))]
        shards = self.layout.usable_shards(int(kv_params.get("shards", 1)))
        receiver = kv_params.get("receiver")
        uuid, transfer_id = new_uuid(), new_transfer_id()
        raw_bytes = len(pages) * self.layout.page_nbytes
        self.pool.retain(pages)
        try:
            transfer = self._publish(uuid, transfer_id, pages, shards, receiver)
        except BaseException:
            self.pool.free(pages)  # nothing will pull it: the pages go back with the request
            raise
        transfer.update(id=transfer_id, uuid=uuid, num_pages=len(pages), group=self.group, pages=pages)
        transfer.setdefault("bytes", raw_bytes)  # on the wire (less if coded)
        transfer["raw_bytes"] = raw_bytes  # before coding
        self.transfer_counts["published"] += 1
        return sign_transfer(self.secret, transfer)

    def _publish(self, uuid: int, transfer_id: str, pages: list[int], shards: int, receiver: dict | None) -> dict:
        """Publishes the pages' KV for the decode group to pull; returns where and how (the
        descriptor's fields but its id and size)."""
        key = TransferKey.of(self.secret, transfer_id)
        deadline = time.monotonic() + self.transfer_timeout_s
        if receiver is not None:  # groups spanning processes: every process sends its own blocks
            checksum = self.runner.call("publish", uuid, (pages, receiver, transfer_id))
            self._published[uuid] = _Published(pages, None, None, deadline)
            return {
                "protocol": "blocks",
                "sender": blocks.describe(self.layout),
                "addresses": self.transfer_addresses,
                "checksum": checksum,
            }
        coded = False
        if self.gather.coded:
            gathered, coded, sent_checksum = self.gather.gather_coded(self.runner.pages, pages, key)
            self.transfer_counts["coded" if coded else "sent_raw"] += 1
        else:
            gathered, sent_checksum = self.gather.gather(self.runner.pages, pages, key)
        arrays = self.layout.to_wire(gathered, shards)
        self.server.await_pull(uuid, arrays)
        structs = self.layout.wire_structs(len(pages), shards, coded)
        self._published[uuid] = _Published(pages, arrays, structs, deadline)
        transfer = {"address": self.server.address(), "shards": shards, "checksum": sent_checksum}
        if coded:
            transfer.update(codec=CODEC, bytes=sum(a.nbytes for a in arrays))
        return transfer

    # -- worker side: every process of a group spanning processes ---------------------------------

    def _publish_blocks(self, uuid: int, inputs) -> int:
        """Gathers a request's pages and sends this process's blocks of them, under ids made
        from the transfer's uuid; returns the pages' keyed checksum."""
        pages, receiver, transfer_id = inputs
        key = TransferKey.of(self.secret, transfer_id)
        gathered, sent_checksum = self.gather.gather(self.runner.pages, pages, key)
        plan, me = blocks.BlockPlan(self.layout, blocks.describe(self.layout), receiver), jax.process_index()
        sent = []
        for _, q in sorted(pair for pair in plan.pairs() if pair[0] == me):
            pair_uuid, pieces = blocks.pair_uuid(uuid, me, q), blocks.pieces_to_send(plan, gathered, q)
            self.server.await_pull(pair_uuid, pieces)
            sent.append((pair_uuid, pieces))
            self.sent_bytes += sum(x.nbytes for x in pieces)
        self._sent[uuid] = sent
        blocks.report_bytes(self.store, self.group, self.sent_bytes)
        return sent_checksum

    def _release_blocks(self, uuid: int, drain_it: bool) -> None:
        """Drops this process's blocks of a transfer (drain_it: also takes them off the
        transfer server)."""
        for pair_uuid, pieces in self._sent.pop(uuid, []):
            if drain_it:
                structs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in pieces]
                self.puller.drain(pair_uuid, structs, self.transfer_timeout_s)

    # -- scheduler side ------------------------------------------------------------------------

    def poll_interval(self) -> float | None:
        return 0.02 if self._published else None

    def update(self) -> Progress:
        now = time.monotonic()
        if now - self._last_control_poll >= CONTROL_POLL_S:
            self._last_control_poll = now
            self._store_words("abandoned pulls", self._answer_abandoned_pulls, now)
            self._store_words("renewals", self._renew, now)
        if self._published and now - self._last_ack_poll >= ACK_POLL_S:
            self._last_ack_poll = now
            self._store_words("acknowledgements", self._take_acks, now)
        for uuid, published in list(self._published.items()):
            if now > published.deadline:
                self._release(uuid, drain_it=True)
                self.transfer_counts["expired"] += 1
        return Progress()

    def _store_words(self, what: str, read, now: float) -> None:
        """read(now): what decode groups left in the store. Malformed words there are logged
        and skipped: they never end the engine (a transfer nobody acknowledges expires)."""
        try:
            read(now)
        except (JfireError, ValueError, TypeError, KeyError) as e:
            print(f"jfire: {self.group}: skipped malformed {what} in the store: {e}", file=sys.stderr, flush=True)

    def _take_acks(self, now: float) -> None:
        for uuid, value in cluster.take_all(self.store, cluster.ack_key(self.group, "")):
            if uuid in self._published:
                # Nobody will pull a dropped one: take it off the transfer server too.
                self._release(uuid, drain_it=value == cluster.DROPPED)
                self.transfer_counts["dropped" if value == cluster.DROPPED else "acknowledged"] += 1

    def _release(self, uuid: int, drain_it: bool = False) -> None:
        published = self._published.pop(uuid)
        self.pool.free(published.pages)
        if published.structs is None:  # sent in blocks, by every process of the group
            self.runner.call("release", uuid, drain_it)
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
            try:
                num_pages, shards, coded = self._abandoned_shape(value)
            except (ValueError, TypeError) as e:  # not one of ours: nothing to answer
                print(f"jfire: {self.group}: skipped an abandoned pull of {uuid}: {e}", file=sys.stderr, flush=True)
                continue
            zeros = placeholder(self.layout, num_pages, shards, coded)
            self.server.await_pull(uuid, zeros)
            # Kept alive while the pull takes them; dropped after a timeout in case it never
            # comes (the pull ended on its own between giving up and this answer).
            self._placeholders[uuid] = (zeros, now + self.transfer_timeout_s)
            self.transfer_counts["abandoned"] += 1
        for uuid, (_, drop_at) in list(self._placeholders.items()):
            if now > drop_at:
                del self._placeholders[uuid]

    def _abandoned_shape(self, value: str) -> tuple[int, int, bool]:
        """(pages, shards, coded) of a pull a decode group gave up on, as it left them in the
        store; ValueError unless they are a transfer this group could have published."""
        shape = json.loads(value)
        if not isinstance(shape, dict):
            raise ValueError(f"an abandoned pull's shape must be an object, got {value[:100]!r}")
        num_pages, shards = shape.get("num_pages"), shape.get("shards")
        if not (blocks.is_int(num_pages) and 1 <= num_pages <= self.pool.num_pages):
            raise ValueError(f"an abandoned pull of {num_pages!r} pages (this group has {self.pool.num_pages})")
        if not (blocks.is_int(shards) and shards >= 1 and self.layout.usable_shards(shards) == shards):
            raise ValueError(f"an abandoned pull in {shards!r} shards, a split this group never sends")
        return num_pages, shards, shape.get("codec") == CODEC and self.gather.coded

    def stats(self) -> dict:
        return {
            "transfers_pending": len(self._published),
            "transfers_published": self.transfer_counts["published"],
            "transfers_acknowledged": self.transfer_counts["acknowledged"],
            "transfers_expired": self.transfer_counts["expired"],
            "transfers_dropped": self.transfer_counts["dropped"],
            "transfers_renewed": self.transfer_counts["renewed"],
            "pulls_abandoned": self.transfer_counts["abandoned"],
            "transfers_coded": self.transfer_counts["coded"],
            # Compressed transfers sent raw: some tile of their pages could not be coded.
            "transfers_sent_raw": self.transfer_counts["sent_raw"],
        }

    def stats_now(self) -> dict:
        # Per process of a group spanning processes: the KV bytes each has sent in blocks.
        return {"kv_bytes_sent_by_process": blocks.read_bytes(self.store, self.group)}


@dataclasses.dataclass(eq=False)
class _Incoming:
    """A prefilled request on its way into the decode group."""

    live: LiveRequest
    first_token: int
    transfer: dict
    first_logprobs: list | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    pull: Pull | None = None
    cancelled: bool = False
    renewed_at: float = dataclasses.field(
        default_factory=time.monotonic
    )  # when the prefill group last heard it is wanted


class DecodeConnector(KVConnector):
    role = "decode"
    program_kinds = ("decode",)
    pages_by_id = True

    def __init__(
        self,
        *,
        server,
        store,
        transfer_timeout_s: float,
        secret: DeploymentSecret,
        prefill_groups: frozenset[str],
        group: str = "decode",
        compress: bool = False,
    ):
        self.server, self.store, self.group = server, store, group
        self.secret = secret  # checks each descriptor's signature and each transfer's keyed sum
        self.prefill_groups = prefill_groups  # the only groups a transfer may come from
        self.taken = RecentIds()  # transfer ids taken: each once
        self.compress = compress
        self.puller = Puller(server)
        self._block_pulls: dict[int, blocks.BlockPulls] = {}  # this process's pulls, per transfer uuid
        self.pulled_bytes = 0  # KV bytes this process pulled (blocks of a group spanning processes)
        self.transfer_timeout_s = transfer_timeout_s
        self._admitting: collections.deque[_Incoming] = collections.deque()  # waiting for pages
        self._pulling: dict[str, _Incoming] = {}
        self.kv_transfer_bytes = 0  # on the wire
        self.kv_transfer_raw_bytes = 0  # before coding
        self.transfer_counts: collections.Counter = collections.Counter()
        self.last_transfer_error: str | None = None

    def bind(self, engine) -> None:
        super().bind(engine)
        self.pool, self.runner = engine.pool, engine.runner
        self.layout = kv_layout(engine)
        coded = _check_codable(self.layout, self.compress)
        self.insert = transfer_programs(engine, self.layout, "insert", coded=coded, keyed=True)
        self.runner.add_calls({"pull": self._pull_blocks, "insert": self._insert_blocks, "forget": self._forget_blocks})

    def side_programs(self) -> list:
        return [self.insert]

    def shutdown(self) -> None:
        self.puller.shutdown()

    # -- worker side: every process of a group spanning processes ---------------------------------

    def _pull_blocks(self, uuid: int, transfer: dict) -> None:
        self._block_pulls[uuid] = blocks.BlockPulls(self.puller, self.layout, transfer, self.transfer_timeout_s)

    def _insert_blocks(self, uuid: int, inputs) -> int:
        """Waits for this process's pulls and writes the pages; returns the keyed checksum of
        what arrived."""
        pages, transfer_id = inputs
        pulls = self._block_pulls.pop(uuid)
        pulls.wait()
        arrays, nbytes = pulls.arrays()
        key = TransferKey.of(self.secret, transfer_id)
        self.runner.pages, arrived = self.insert.insert(self.runner.pages, arrays, pages, key=key)
        self.pulled_bytes += nbytes
        blocks.report_bytes(self.store, self.group, self.pulled_bytes)
        return arrived

    def _forget_blocks(self, uuid: int, _) -> None:
        self._block_pulls.pop(uuid, None)

    # -- scheduler side ------------------------------------------------------------------------

    def check(self, request_id, prompt_ids, sampling: SamplingParams, kv_params) -> SamplingParams:
        """Everything the engine thread will read of the transfer, checked here (at submit, on
        the caller's thread): a bad one is refused, and never reaches the engine thread."""
        check_prefilled(request_id, kv_params, sampling)
        transfer = kv_params["transfer"]
        if not isinstance(transfer, dict) or not signed_by_deployment(self.secret, transfer):
            raise JfireError(
                "the KV transfer is not signed by a prefill group of this deployment (or was changed on the "
                "way); pass on the 'transfer' a prefill group answered, unchanged"
            )
        expected = self.engine.scheduler.pages_needed(len(prompt_ids))
        if not blocks.is_int(transfer.get("num_pages")) or transfer["num_pages"] != expected:
            raise JfireError(
                f"the transfer has {transfer.get('num_pages')} pages but a {len(prompt_ids)}-token "
                f"prompt fills {expected} pages of {self.engine.config.page_size} tokens"
            )
        codec = transfer.get("codec")
        if codec is not None and (codec != CODEC or not self.insert.coded):
            known = f"{CODEC!r} (with [transfer] compress = true)" if not self.insert.coded else repr(CODEC)
            raise JfireError(f"the transfer's pages are coded as {codec!r}; this decode group decodes {known}")
        check_fields(transfer, self.layout, self.prefill_groups)
        if not self.taken.take(transfer["id"]):
            raise JfireError(f"the KV transfer {transfer['id']} was taken already; each transfer is pulled once")
        return sampling

    def loads(self, live: LiveRequest) -> bool:
        return True

    def hold(self, live: LiveRequest) -> None:
        kv = live.kv_params or {}
        self._admitting.append(_Incoming(live, int(kv["first_token"]), kv["transfer"], kv.get("first_logprobs")))

    def cancel(self, request_id: str) -> None:
        for incoming in [*self._admitting, *self._pulling.values()]:
            if incoming.live.seq.request_id == request_id:
                incoming.cancelled = True

    def held_requests(self) -> list[LiveRequest]:
        held = [*self._admitting, *self._pulling.values()]
        self._admitting.clear()
        self._pulling.clear()
        for incoming in held:
            self._drop(incoming)
        return [incoming.live for incoming in held]

    def has_pending(self) -> bool:
        return bool(self._admitting) or bool(self._pulling)

    def poll_interval(self) -> float | None:
        return 0.002 if self.has_pending() else None

    def update(self) -> Progress:
        progress = Progress()
        self._admit(progress)
        self._keep_waiting_caches()
        for request_id, incoming in list(self._pulling.items()):
            if incoming.pull is not None and incoming.pull.done:
                del self._pulling[request_id]
                self._one_request(incoming, progress, "taking in its KV cache", self._arrive)
            elif incoming.pull is not None and incoming.pull.expired:
                del self._pulling[request_id]
                self._one_request(incoming, progress, "giving up its pull", self._give_up)
        return progress

    def _one_request(self, incoming: _Incoming, progress: Progress, what: str, step) -> None:
        """step(incoming, progress), which concerns this request alone: if it raises, the
        request fails and the engine serves the others on."""
        try:
            step(incoming, progress)
        except Exception as e:  # noqa: BLE001 - one request's transfer, never the engine's end
            print(f"jfire: {self.group}: {what} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if incoming.live.seq.phase is not Phase.FINISHED:
                self._fail(incoming, f"{what} failed: {type(e).__name__}: {e}", progress)

    def _give_up(self, incoming: _Incoming, progress: Progress) -> None:
        t = incoming.transfer
        if t.get("protocol") == "blocks":
            self.runner.call("forget", t["uuid"], None)
        # The pull is still blocked: the sender ends it (see kv_transfer.Pull).
        self.store.key_value_set(
            cluster.abandon_key(t["group"], t["uuid"]),
            json.dumps({"num_pages": t["num_pages"], "shards": t.get("shards", 1), "codec": t.get("codec")}),
        )
        self._fail(
            incoming,
            f"the KV cache from prefill group {t.get('group')!r} did not arrive within "
            f"{self.transfer_timeout_s:g} s; the request was dropped",
            progress,
        )

    def _admit(self, progress: Progress) -> None:
        """Starts pulls in arrival order while batch slots and pages for whole requests last."""
        while self._admitting:
            incoming = self._admitting[0]
            if incoming.cancelled:
                self._admitting.popleft()
                self._fail(incoming, None, progress)
                continue
            if len(self.engine.scheduler.running) + len(self._pulling) >= self.engine.config.max_batch:
                return
            seq = incoming.live.seq
            pages = self.pool.allocate(
                self.engine.scheduler.pages_needed(len(seq.prompt_ids) + seq.sampling.max_tokens)
            )
            if pages is None:
                return
            self._admitting.popleft()
            incoming.pages = pages
            self._one_request(incoming, progress, "starting its pull", self._start_pull)

    def _start_pull(self, incoming: _Incoming, progress: Progress) -> None:
        t = incoming.transfer
        if t.get("protocol") == "blocks":
            self.runner.call("pull", t["uuid"], t)
            incoming.pull = self._block_pulls[t["uuid"]]
        else:
            structs = self.layout.wire_structs(t["num_pages"], t["shards"], t.get("codec") == CODEC)
            incoming.pull = self.puller.pull(t["address"], t["uuid"], structs, self.transfer_timeout_s)
        self._pulling[incoming.live.seq.request_id] = incoming

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

    def _arrive(self, incoming: _Incoming, progress: Progress) -> None:
        t = incoming.transfer
        assert incoming.pull is not None
        if incoming.pull.error is not None:
            if t.get("protocol") == "blocks":
                self.runner.call("forget", t["uuid"], None)
            self._fail(
                incoming,
                f"pulling the KV cache from prefill group {t.get('group')!r} failed: {incoming.pull.error}",
                progress,
            )
            return
        if t.get("protocol") == "blocks":
            # Every process of the group writes its blocks (followers wait for their own
            # pulls); the checksum, a sum over all of them, is read once they all have.
            if incoming.cancelled:  # pulled, so acknowledged as such (a drain would find nothing to take)
                self.runner.call("forget", t["uuid"], None)
                self.store.key_value_set(cluster.ack_key(t["group"], t["uuid"]), cluster.PULLED)
                self._fail(incoming, None, progress)
                return
            arrived = self.runner.call("insert", t["uuid"], (incoming.pages[: t["num_pages"]], t["id"]))
            self.store.key_value_set(cluster.ack_key(t["group"], t["uuid"]), cluster.PULLED)
            nbytes = t["bytes"]
        else:
            # Acknowledge at once: the prefill group frees its pages as soon as it reads this.
            self.store.key_value_set(cluster.ack_key(t["group"], t["uuid"]), cluster.PULLED)
            if incoming.cancelled:
                self._fail(incoming, None, progress)
                return
            arrays = incoming.pull.arrays
            coded = t.get("codec") == CODEC
            page_ids = incoming.pages[: t["num_pages"]]
            key = TransferKey.of(self.secret, t["id"])
            self.runner.pages, arrived = self.insert.insert(self.runner.pages, arrays, page_ids, coded, key)
            nbytes = sum(a.nbytes for a in arrays)
        if arrived != t["checksum"]:
            self._corrupted(incoming, arrived, progress)
            return
        self.kv_transfer_bytes += nbytes
        self.kv_transfer_raw_bytes += t.get("raw_bytes", nbytes)
        self.transfer_counts["pulled"] += 1
        incoming.live.seq.pages = incoming.pages
        progress.loaded.append(Loaded(incoming.live, incoming.first_token, incoming.first_logprobs))

    def _corrupted(self, incoming: _Incoming, arrived: int, progress: Progress) -> None:
        """A transfer whose bytes differ from those sent: a sender killed mid-transfer can cause
        it, or bytes nobody of this deployment sent (its keyed sum fits no others). Counted,
        logged with what it involved, and the request failed."""
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
            "mid-transfer, a fault in the transfer, or bytes this deployment did not send (logged by "
            "the decode group); the request was dropped",
            progress,
        )

    def _drop(self, incoming: _Incoming) -> None:
        """Lets go of a request that never joined the batch: its pages back to the pool, and
        the prefill group told at once if it was never pulled (not at its timeout)."""
        if incoming.pull is None:
            t = incoming.transfer
            self.store.key_value_set(cluster.ack_key(t["group"], t["uuid"]), cluster.DROPPED, allow_overwrite=True)
        self.pool.free(incoming.pages)
        incoming.pages = []
        incoming.live.seq.phase = Phase.FINISHED

    def _fail(self, incoming: _Incoming, error: str | None, progress: Progress) -> None:
        """Ends a request that never joined the batch: cancelled (error None) or failed."""
        self._drop(incoming)
        if error is not None:
            self.transfer_counts["failed"] += 1
            self.last_transfer_error = error
        progress.failed.append(Failed(incoming.live, error))

    def num_waiting(self) -> int:
        return len(self._admitting)

    def stats(self) -> dict:
        return {
            "transferring": len(self._pulling),
            "kv_transfer_bytes": self.kv_transfer_bytes,
            "kv_transfer_raw_bytes": self.kv_transfer_raw_bytes,
            "kv_transfers": self.transfer_counts["pulled"],
            "transfers_failed": self.transfer_counts["failed"],
            "transfers_corrupted": self.transfer_counts["corrupted"],
            # Why the last transfer failed: a rare failure under load names its cause.
            "last_transfer_error": self.last_transfer_error,
            "pull_threads": self.puller.in_flight,
        }

    def stats_now(self) -> dict:
        # Per process of a group spanning processes: the KV bytes each has pulled in blocks.
        return {"kv_bytes_pulled_by_process": blocks.read_bytes(self.store, self.group)}


def _check_codable(layout: KVLayout, compress: bool) -> bool:
    """Whether this side's pages travel coded; JfireError if asked for a cache that cannot."""
    if compress and not layout.codable:
        raise JfireError(
            f"[transfer] compress codes bfloat16 or float32 KV caches, but this group's cache is "
            f"{jax.numpy.dtype(layout.dtype).name}; set compress = false in the deployment file"
        )
    return compress
