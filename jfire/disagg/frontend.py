"""The frontend of a split deployment: the OpenAI-compatible service in front of the groups.

`RemoteEngine` implements `jfire.client.EngineClient`, the interface serve/ uses of the local
engine too, so the HTTP service is the same code in both modes. Each request:
  1. picks a prefill group: where the groups hold different lengths of the prompt's prefix
     (jfire.disagg.prefix_index), the one with the least work, counting the blocks it would
     compute, the prompts it is prefilling already, and the `x-session-affinity` key's group
     as holding AFFINITY_BLOCKS more; else the group the key hashes to, so a conversation's
     prefix cache keeps hitting; else the least loaded; and a decode group (least loaded);
  2. asks the prefill group to run the prompt: it answers with the first token and where its
     KV cache waits to be pulled, in the wire split the decode group asked for;
  3. hands that to the decode group and relays its streamed outputs.
A group that stops answering fails its requests at once with a clear error and is marked
down (/health says "degraded"); routing skips it while it is down. When `jfire launch` has
restarted it, it registers again in the store; the frontend adopts the new registration and
routes to it once it answers.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import sys
import threading
from collections.abc import Callable

import httpx

from jfire.deployment_secret import DeploymentSecret
from jfire.disagg import cluster
from jfire.disagg.deployment import Deployment
from jfire.disagg.prefix_index import PrefixIndex
from jfire.errors import EngineStopped, JfireError
from jfire.grammar import Grammars
from jfire.request_checks import RequestChecks, context_limit
from jfire.requests import RequestHandle, RequestOutput
from jfire.sampling import SamplingParams
from jfire.vision.encoder import place_images

HEALTH_POLL_S = 0.5
# Routing by prefix weighs the blocks a group would have to compute against its queue: each
# prompt it is prefilling already counts as this many blocks of work (NVIDIA Dynamo's KV router
# weighs overlap against load the same way). Sessions sharing a long system prompt thus spread
# over the groups, and a session's later turns, whose own history only one group holds, stay.
PREFIX_LOAD_BLOCKS = 16
# An `x-session-affinity` key counts as this many cached blocks for the group it names: it
# decides between groups whose holdings differ by less (a short system prompt one group has
# seen first), and gives way to a group holding more of the conversation than that.
AFFINITY_BLOCKS = 16
SLOW_POLLS_DOWN = 3  # consecutive timed-out polls before a group that still accepts connections is down


class _GroupState:
    def __init__(self, name: str, role: str):
        self.name, self.role = name, role
        self.info: dict | None = None  # what the group registered (control address, pid, ...)
        self.alive = False
        self.stats: dict = {}
        self.in_flight = 0
        self.slow_polls = 0
        self.problem: str | None = None
        self.restarts = 0  # registrations adopted after the first

    def describe(self) -> dict:
        info = self.info or {}
        return {
            "role": self.role,
            "alive": self.alive,
            "pid": info.get("pid"),
            "control": info.get("control"),
            "transfer": info.get("transfer"),
            "mesh": info.get("mesh"),
            "devices": info.get("devices"),
            "kv_shards": info.get("kv_shards"),  # decode groups: the pieces a KV cache travels in
            "in_flight": self.in_flight,
            "restarts": self.restarts,
            "compiling": bool(self.stats.get("compiling")),
            **({"problem": self.problem} if self.problem else {}),
        }


class RemoteEngine:
    def __init__(
        self,
        deployment: Deployment,
        store,
        config,
        tokenizer,
        *,
        max_model_len: int | None = None,
        max_waiting: int = 1024,
        route_by_prefix: bool = True,
        vision=None,
        secret: DeploymentSecret,
    ):
        self.deployment = deployment
        # The model's image preprocessing and placeholders (jfire.vision.model, loaded without
        # its encoder: the prefill groups encode), or None for a text-only model.
        self.vision = vision
        self.store = store
        self.tokenizer = tokenizer
        self.vocab_size = config.vocab_size
        self.model_type = getattr(config, "model_type", None)
        eos = frozenset(config.eos_token_ids) | (tokenizer.eos_ids if tokenizer else frozenset())
        self.max_model_len = context_limit(config, max_model_len)
        # The page check is the decode group's: it knows its pool. The queue is of requests
        # waiting for prefill.
        self.checks = RequestChecks(
            config.vocab_size,
            self.max_model_len,
            Grammars(tokenizer, config.vocab_size, eos),
            tokenizer is not None,
            queue=lambda: (sum(s.in_flight for s in self.groups.values() if s.role == "prefill"), self.max_waiting),
        )
        self.max_waiting = max_waiting
        self.groups = {g.name: _GroupState(g.name, g.role) for g in deployment.groups}
        self.route_by_prefix = route_by_prefix
        self.prefix_index: PrefixIndex | None = None  # made once the groups say their page size
        self.ready = threading.Event()
        self.stopping = False  # drained: the launcher is stopping the groups
        self.error: BaseException | None = None
        # The frontend fails requests one by one; it never fails for good, so never calls this.
        self.on_fatal: Callable[[BaseException], None] | None = None
        # Every call to a group carries the deployment's control token (jfire.disagg.control_guard).
        self._http = httpx.Client(
            headers={"Authorization": f"Bearer {secret.bearer()}"},
            timeout=httpx.Timeout(10.0, read=600.0),
            limits=httpx.Limits(max_connections=512),
            trust_env=False,
        )
        self._lock = threading.Lock()
        self._active: dict[str, _Stream] = {}  # requests submitted and not yet ended
        self._cancelled: set[str] = set()  # of those, the ones a client gave up on
        self._prefilling: dict[str, _GroupState] = {}  # request id -> the prefill group running its prompt
        self._counts = collections.Counter()
        self._ids = itertools.count()
        self._stop = threading.Event()

    # -- life cycle ------------------------------------------------------------------------

    def start(self, timeout_s: float = 1800.0) -> None:
        """Waits (in the background) for every group to register, then serves."""
        threading.Thread(target=self._wait_for_groups, args=(timeout_s,), name="jfire-groups", daemon=True).start()

    def _wait_for_groups(self, timeout_s: float) -> None:
        try:
            for state in self.groups.values():
                info = cluster.wait_group(self.store, state.name, timeout_s)
                if "error" in info:
                    raise JfireError(f"group {state.name!r} failed to start: {info['error']}")
                state.info, state.alive = info, True
            self._index_groups()
        except Exception as e:  # noqa: BLE001 - a timeout from the store, or a group's start-up error
            self.error = e if isinstance(e, JfireError) else JfireError(f"groups did not register: {e}")
            print(f"jfire: frontend: error: {self.error}", file=sys.stderr, flush=True)
            return
        self.ready.set()
        threading.Thread(target=self._watch, name="jfire-health", daemon=True).start()
        for name, state in self.groups.items():
            i = state.info
            print(
                f"jfire: frontend: {name}: {state.role}, pid {i['pid']}, mesh {i['mesh']} ({i['devices']} devices), "
                f"control {i['control']}, KV transfer {i['transfer']}",
                file=sys.stderr,
                flush=True,
            )

    def shutdown(self) -> None:
        self._stop.set()

    def _index_groups(self) -> None:
        """The prefix index over the prefill groups, sized to each one's caches."""
        infos = {s.name: s.info or {} for s in self.groups.values() if s.role == "prefill"}
        page_sizes = {info.get("page_size") for info in infos.values()}
        page_size = page_sizes.pop() if len(page_sizes) == 1 else None
        if not self.route_by_prefix or len(infos) < 2 or not isinstance(page_size, int):
            return  # one group needs no choosing; groups cutting blocks differently cannot share an index
        self.prefix_index = PrefixIndex(page_size)
        for name, info in infos.items():
            self.prefix_index.set_capacity(name, info.get("cache_blocks") or info.get("pages_total", 1))

    def _watch(self) -> None:
        """Polls every group's stats: load for routing, liveness for /health."""
        while not self._stop.wait(HEALTH_POLL_S):
            for state in self.groups.values():
                if not state.alive and not self._adopt_new_registration(state):
                    continue  # its restart failed: nothing to poll
                try:
                    r = self._http.get(state.info["control"] + "/stats", timeout=2.0)
                    r.raise_for_status()
                    state.stats, state.alive, state.problem, state.slow_polls = r.json(), True, None, 0
                except httpx.ConnectError as e:  # nothing listens: the process is gone
                    self._mark_down(state, f"not answering ({type(e).__name__})")
                except httpx.HTTPError as e:  # busy or stuck: down only if it stays that way
                    state.slow_polls += 1
                    if state.slow_polls >= SLOW_POLLS_DOWN:
                        self._mark_down(state, f"not answering for {state.slow_polls} polls ({type(e).__name__})")

    def _adopt_new_registration(self, state: _GroupState) -> bool:
        """A group that is down may have been restarted: take what it registered since.
        False if its restart failed (it registered an error instead)."""
        info = cluster.read_group(self.store, state.name)
        if info is None or info == state.info:
            return True
        if "error" in info:
            state.problem = f"restart failed: {info['error']}"
            return False
        print(
            f"jfire: frontend: group {state.name!r} registered again (pid {info.get('pid')}, control "
            f"{info.get('control')})",
            file=sys.stderr,
            flush=True,
        )
        state.info, state.slow_polls = info, 0
        state.restarts += 1
        if self.prefix_index is not None and state.role == "prefill":  # a new process: empty caches
            self.prefix_index.forget(state.name)
            self.prefix_index.set_capacity(state.name, info.get("cache_blocks") or info.get("pages_total", 1))
        return True

    def _mark_down(self, state: _GroupState, problem: str) -> None:
        if state.alive and not self.stopping:  # groups stopping after a drain are not news
            print(f"jfire: frontend: group {state.name!r} is down: {problem}", file=sys.stderr, flush=True)
        state.alive, state.problem = False, problem
        if self.prefix_index is not None:
            self.prefix_index.forget(state.name)

    def health(self) -> tuple[int, dict]:
        if self.error is not None:
            return 503, {"status": "error", "message": str(self.error)}
        if not self.ready.is_set():
            return 503, {"status": "starting", "message": "waiting for the prefill and decode groups to start"}
        groups = {name: s.describe() for name, s in self.groups.items()}
        down = [name for name, s in self.groups.items() if not s.alive]
        # As a colocated server says it: serving already, some programs still compiling.
        compiling = any(g["compiling"] for g in groups.values() if g["alive"])
        if not down:
            return 200, {"status": "ok", "compiling": compiling, "groups": groups}
        serving = all(any(s.alive for s in self.groups.values() if s.role == role) for role in ("prefill", "decode"))
        message = f"group(s) {', '.join(down)} down; " + (
            "serving with the rest" if serving else "no live group for a role: requests fail"
        )
        return (200 if serving else 503), {"status": "degraded", "message": message, "groups": groups}

    def stats(self) -> dict:
        """The groups' engine stats summed (from the last poll), plus what the frontend counts."""
        total: dict = collections.Counter()
        for s in self.groups.values():
            for key, value in s.stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "pid":
                    total[key] += value
        out = dict(total)
        out["kv_transfer_bytes"] = self._counts["kv_transfer_bytes"]
        out["kv_transfer_raw_bytes"] = self._counts["kv_transfer_raw_bytes"]
        out["kv_transfers"] = self._counts["kv_transfers"]
        out["kv_handoffs"] = self._counts["kv_handoffs"]
        for how in ("prefix", "affinity", "load"):  # how each request's prefill group was chosen
            out[f"routed_by_{how}"] = self._counts[f"routed_by_{how}"]
        out["prefix_fetches"] = self._counts["prefix_fetches"]  # prompts told to fetch blocks from another group
        out["running"] = sum(s.in_flight for s in self.groups.values() if s.role == "decode")
        return out

    # -- requests --------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return self.ready.is_set()

    def validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.checks.check(prompt_ids, sampling)

    def submit(
        self,
        prompt_ids,
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        on_output=None,
        affinity: str | None = None,
        after: str | None = None,
        images=(),
    ):
        """`after` (n > 1 sharing a prompt) only matters inside one engine; each choice here
        goes its own way (with `affinity`, to the same prefill group, whose cache it may hit).
        `images` as Engine.submit's: they go to the prefill group with the prompt."""
        if self.error is not None:
            raise EngineStopped(f"the deployment failed to start: {self.error}")
        prompt_ids = [int(i) for i in prompt_ids]
        self.validate(prompt_ids, sampling)
        placed = place_images(self.vision, prompt_ids, images)
        self.checks.admit()
        request_id = request_id or f"req-{next(self._ids)}"
        # Both groups must draw from the same seed: prefill samples the first token, decode the rest.
        sampling = SamplingParams(**{**sampling.__dict__, "seed": sampling.resolved_seed()})
        handle = RequestHandle(self, request_id, prompt_ids, self.tokenizer is not None)
        stream = _Stream(on_output or handle.outputs.put)
        with self._lock:
            self._active[request_id] = stream
        threading.Thread(
            target=self._run,
            args=(request_id, prompt_ids, sampling, stream.emit, affinity, placed),
            name=f"jfire-{request_id}",
            daemon=True,
        ).start()
        return handle

    def cancel(self, request_id: str) -> None:
        """Ends a request wherever it is: a prefill group still holding it (queued or running
        its prompt) is told at once; a decode group's stream is left, which cancels it there."""
        with self._lock:
            if request_id not in self._active:  # ended already: nothing to cancel, nothing to remember
                return
            self._cancelled.add(request_id)
            group = self._prefilling.get(request_id)
        if group is not None:  # called from the server's event loop: the call goes out on a thread
            threading.Thread(
                target=self._cancel_prefill, args=(group, request_id), name="jfire-cancel", daemon=True
            ).start()

    def fail_all(self, message: str) -> None:
        """Ends every request in flight with finish_reason "error" and this message, and
        cancels each where it runs (a server shutting down after its grace period)."""
        with self._lock:
            active = list(self._active.items())
        for request_id, stream in active:
            stream.emit(RequestOutput(request_id, [], "", finished=True, finish_reason="error", error=message))
            self.cancel(request_id)

    def _cancel_prefill(self, group: _GroupState, request_id: str) -> None:
        try:
            self._http.post(group.info["control"] + "/cancel", json={"request_id": request_id}, timeout=5.0)
        except httpx.HTTPError:
            pass  # the group is down: its requests end with it

    def generate(self, requests):
        return [h.result() for h in [self.submit(ids, sp) for ids, sp in requests]]

    def _pick(self, role: str, affinity: str | None = None, hashes: list[bytes] | None = None) -> _GroupState:
        live = sorted((s for s in self.groups.values() if s.role == role and s.alive), key=lambda s: s.name)
        if not live:
            raise JfireError(
                f"no {role} group is up (all are down: "
                f"{', '.join(s.name for s in self.groups.values() if s.role == role)})"
            )

        def load(s: _GroupState):
            return (s.in_flight, s.stats.get("waiting", 0), -s.stats.get("pages_free", 0))

        least = min(live, key=load)
        if role != "prefill":
            return least
        if self.prefix_index is not None and hashes:
            matched = {s.name: self.prefix_index.matched(s.name, hashes) for s in live}
            if max(matched.values()) > min(matched.values()):  # the prefix tells the groups apart
                prefilling = collections.Counter(g.name for g in self._prefilling.values())
                keyed = live[affinity_index(affinity, len(live))] if affinity else None

                def cost(s: _GroupState):
                    bonus = AFFINITY_BLOCKS if s is keyed else 0
                    return len(hashes) - matched[s.name] - bonus + PREFIX_LOAD_BLOCKS * prefilling[s.name]

                chosen = min(live, key=lambda s: (cost(s), load(s)))
                self._counts["routed_by_affinity" if chosen is keyed else "routed_by_prefix"] += 1
                return chosen
        if affinity:
            self._counts["routed_by_affinity"] += 1
            return live[affinity_index(affinity, len(live))]
        self._counts["routed_by_load"] += 1
        return least

    def _prefix_source(self, chosen: _GroupState, hashes: list[bytes] | None) -> dict | None:
        """Where the chosen prefill group can fetch the leading blocks of the prompt it lacks
        (jfire.disagg.prefix_store): the live group of the same KV layout thought to hold the
        most of them, when that is more than the chosen group holds; else None."""
        mine = chosen.info or {}
        if self.prefix_index is None or not hashes or not mine.get("shares_prefixes"):
            return None
        have = self.prefix_index.matched(chosen.name, hashes)
        holders = [
            (self.prefix_index.matched(s.name, hashes), s.name)
            for s in self.groups.values()
            if s.role == "prefill" and s.alive and s is not chosen
            for info in [s.info or {}]
            if info.get("shares_prefixes") and info.get("kv_layout") == mine.get("kv_layout")
        ]
        held, holder = max(holders, key=lambda h: h[0], default=(0, None))
        if holder is None or held <= have:
            return None
        self._counts["prefix_fetches"] += 1
        # By name: the chosen group asks it at the address it registered itself.
        return {"group": holder, "first": have, "blocks": held}

    def _run(self, request_id, prompt_ids, sampling, emit, affinity, placed=None) -> None:
        def fail(message: str) -> None:
            emit(
                RequestOutput(
                    request_id,
                    [],
                    "",
                    finished=True,
                    finish_reason="error",
                    error=message,
                    prompt_tokens=len(prompt_ids),
                )
            )

        extra_keys = placed.extra_keys if placed is not None else None
        hashes = (
            self.prefix_index.hashes(prompt_ids, extra_keys, sampling.cache_salt)
            if self.prefix_index is not None
            else None
        )
        try:
            with self._lock:
                prefill, decode = self._pick("prefill", affinity, hashes), self._pick("decode")
                prefix_from = self._prefix_source(prefill, hashes)
        except JfireError as e:
            return fail(str(e))
        with self._lock:
            prefill.in_flight += 1
            decode.in_flight += 1
        try:
            with self._lock:
                self._prefilling[request_id] = prefill
            try:
                first = self._prefill(prefill, decode, request_id, prompt_ids, sampling, prefix_from, placed)
            finally:
                with self._lock:
                    self._prefilling.pop(request_id, None)
            if isinstance(first, str) and self._take_cancel(request_id):
                return emit(RequestOutput(request_id, [], "", finished=True, finish_reason="cancelled"))
            if isinstance(first, str):
                return fail(first)
            if self.prefix_index is not None and hashes:  # the group holds the prompt's blocks now
                self.prefix_index.record(prefill.name, hashes)
            if self._take_cancel(request_id):
                # Nobody will pull it: acknowledge on the decode side's behalf so the prefill
                # group frees the pages now rather than at the timeout.
                self.store.key_value_set(cluster.ack_key(prefill.name, first["transfer"]["uuid"]), cluster.DROPPED)
                return emit(RequestOutput(request_id, [], "", finished=True, finish_reason="cancelled"))
            error = self._decode(decode, request_id, prompt_ids, sampling, first, emit)
            if error:
                fail(error)
        finally:
            with self._lock:
                prefill.in_flight -= 1
                decode.in_flight -= 1
                self._cancelled.discard(request_id)
                self._active.pop(request_id, None)

    def _take_cancel(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled

    def _prefill(
        self, group: _GroupState, decode: _GroupState, request_id, prompt_ids, sampling, prefix_from=None, placed=None
    ) -> dict | str:
        """The prefill group's answer, or an error message. `prefix_from`: another prefill
        group to fetch the prompt's leading blocks from first (`_prefix_source`); `placed`:
        the prompt's images (jfire.vision.encoder.RequestImages)."""
        body = {
            "request_id": request_id,
            "prompt_ids": prompt_ids,
            "sampling": sampling.to_json(),
            "shards": decode.info.get("kv_shards", 1),
            "prefix_from": prefix_from,
            "images": [image.to_json() for image in placed.images] if placed is not None else [],
        }
        if max(group.info.get("processes", 1), decode.info.get("processes", 1)) > 1:
            # A group spanning processes: each process sends or pulls its own blocks of the
            # cache (jfire.disagg.blocks), cut to the decode group's layout.
            body["receiver"] = decode.info["kv_layout"]
        try:
            r = self._http.post(group.info["control"] + "/prefill", json=body)
        except httpx.HTTPError as e:
            self._mark_down(group, f"prefill request failed ({type(e).__name__})")
            return (
                f"prefill group {group.name!r} failed before publishing this request's KV cache: "
                f"{type(e).__name__} ({e or 'connection lost'}); the process may have stopped"
            )
        if r.status_code != 200:
            return f"prefill group {group.name!r}: {_error_of(r)}"
        with self._lock:  # published, and the frontend knows where: the decode group pulls from here on
            self._counts["kv_handoffs"] += 1
        return r.json()

    def _decode(self, group: _GroupState, request_id, prompt_ids, sampling, first: dict, emit) -> str | None:
        """Relays the decode group's outputs; returns an error message if it failed."""
        body = {
            "request_id": request_id,
            "prompt_ids": prompt_ids,
            "first_token": first["first_token"],
            "first_logprobs": first.get("first_logprobs"),
            "sampling": sampling.to_json(),
            "transfer": first["transfer"],
        }
        arrived = emitted_prompt_logprobs = False
        try:
            with self._http.stream(
                "POST",
                group.info["control"] + "/decode",
                json=body,
                timeout=httpx.Timeout(10.0, read=self.deployment.transfer_timeout_s + 60),
            ) as r:
                if r.status_code != 200:
                    r.read()
                    return f"decode group {group.name!r}: {_error_of(r)}"
                for line in r.iter_lines():
                    if not line:
                        continue
                    out = RequestOutput(**json.loads(line))
                    if not arrived and (out.token_ids or out.finish_reason != "error"):
                        arrived = True  # the decode group has the KV cache
                        with self._lock:
                            self._counts["kv_transfer_bytes"] += first["transfer"]["bytes"]
                            raw = first["transfer"].get("raw_bytes", first["transfer"]["bytes"])
                            self._counts["kv_transfer_raw_bytes"] += raw
                            self._counts["kv_transfers"] += 1
                    out.prefix_hit_tokens = first.get("prefix_hit_tokens", 0)
                    if not emitted_prompt_logprobs:  # the prefill group computed them
                        out.prompt_logprobs, emitted_prompt_logprobs = first.get("prompt_logprobs"), True
                    emit(out)
                    if out.finished:
                        return None
                    if self._take_cancel(request_id):
                        emit(
                            RequestOutput(
                                request_id,
                                [],
                                "",
                                finished=True,
                                finish_reason="cancelled",
                                prompt_tokens=out.prompt_tokens,
                                completion_tokens=out.completion_tokens,
                            )
                        )
                        return None  # leaving the stream closes it: the decode group cancels
        except httpx.HTTPError as e:
            self._mark_down(group, f"stream broke ({type(e).__name__})")
            return (
                f"decode group {group.name!r} stopped answering mid-stream: {type(e).__name__} "
                f"({e or 'connection lost'}); the request was not completed"
            )
        return f"decode group {group.name!r} ended the stream without finishing the request"


class _Stream:
    """A request's outputs on their way to its consumer: nothing after the one that finished
    it (a request failed by fail_all while its thread still relays)."""

    def __init__(self, emit):
        self._emit, self._finished, self._lock = emit, False, threading.Lock()

    def emit(self, out: RequestOutput) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = out.finished
        self._emit(out)


def affinity_index(key: str, n: int) -> int:
    """Which of n live prefill groups (sorted by name) a session key goes to: stable across
    requests and processes (Python's own hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest()) % n


def _error_of(r: httpx.Response) -> str:
    try:
        return r.json().get("error") or r.text
    except ValueError:
        return r.text or f"HTTP {r.status_code}"
