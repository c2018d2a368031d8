"""The serving engine: continuous batching over AOT-compiled prefill and decode programs.

One thread owns the device state and the scheduler. Callers talk to it through `submit` /
`cancel` / `stats`, which only enqueue commands or read snapshots, so an HTTP handler never
blocks a step and a step never waits on a client. The engine is the loop and the life cycle;
its parts do the work (docs/architecture.md): the `Scheduler` (jfire/scheduler.py) picks each
step's prefill chunks and decode rows; the `ModelRunner` (jfire/runner.py) builds the step's
inputs and runs the programs; the `OutputProcessor` (jfire/outputs.py) turns sampled tokens
into outputs; a `KVConnector` (jfire/kv_connector.py) brings KV from elsewhere or sends it on
(a split deployment's roles); a `Speculator` (jfire/speculative) drafts and verifies.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from jfire.checkpoint.load import LoadedModel
from jfire.client import serving_health
from jfire.compile_cache import enable_compilation_cache
from jfire.engine_config import EngineConfig
from jfire.errors import EngineStopped
from jfire.grammar import Grammars
from jfire.kv_cache import KVPools
from jfire.kv_connector import KVConnector, Progress
from jfire.outputs import LiveRequest, OutputProcessor
from jfire.request_checks import RequestChecks, context_limit
from jfire.requests import Completion, RequestHandle, RequestOutput
from jfire.runner import ModelRunner
from jfire.sampling import SamplingParams
from jfire.scheduler import Phase, Scheduler, Sequence, Step
from jfire.speculative.speculator import Speculator


class Engine:
    """Serving: the loop over the scheduler, the runner and the output processor, with a KV
    connector for KV that comes from or goes to other engines (`jfire.kv_connector`)."""

    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig(), connector: KVConnector | None = None):
        self.model = model
        self.config = config
        self.connector = connector or KVConnector()
        cfg = model.config
        self.max_model_len = context_limit(cfg, config.max_model_len)
        self.eos_ids = frozenset(cfg.eos_token_ids) | (model.tokenizer.eos_ids if model.tokenizer else frozenset())
        shared = self.connector.pages_by_id or not config.pool_per_kind
        self.runner = ModelRunner(model, config, self.max_model_len, self.eos_ids, self.connector.program_kinds, shared)
        self.pools: KVPools = self.runner.pools
        self.pool = self.pools.first  # what a connector moving pages by id works with
        self.scheduler = Scheduler.for_engine(self.pools, config, self.connector.load_prefix)
        self.speculator = Speculator.for_engine(config, self.eos_ids, self.max_model_len, self.connector.program_kinds)
        grammars = Grammars(model.tokenizer, cfg.vocab_size, self.eos_ids)
        self.outputs = OutputProcessor(
            model.tokenizer,
            grammars,
            self.eos_ids,
            self.max_model_len,
            on_finished=self._on_finished,
            cancel=self.cancel,
        )
        # What a server reads (jfire.client.EngineClient).
        self.tokenizer = model.tokenizer
        self.vocab_size = cfg.vocab_size
        self.vision = self.runner.images.vision  # None: a text-only model
        self.model_type: str | None = getattr(cfg, "model_type", None)
        self.checks = RequestChecks(
            cfg.vocab_size,
            self.max_model_len,
            grammars,
            model.tokenizer is not None,
            lambda n: self.pools.shortfall(n, max(config.prefill_budget, 2)),
            lambda: (len(self.scheduler.waiting) + self._commands.qsize(), self.config.max_waiting),
        )
        self._commands: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats: dict = {}
        self._recent: list[tuple[float, int]] = []  # (time, tokens) of recent steps, for tokens/s
        self.ready = threading.Event()
        self.startup_s: float | None = None  # until the engine serves
        self.compiled_s: float | None = None  # until every program is compiled
        self._compiler: threading.Thread | None = None
        # Called (on the engine thread) once the engine has failed for good, after every
        # request it held has been ended: a server stops and exits non-zero.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.error: BaseException | None = None
        self.connector.bind(self)

    @property
    def programs(self):
        return self.runner.programs

    # -- life cycle ----------------------------------------------------------------------------

    def start(self, compile_progress: Callable[[int, int], None] | None = None, *, run_loop: bool = True) -> Engine:
        """Compiles the programs ahead of time, then starts the engine thread: every bucket
        first, or with `serve_while_compiling` only the essential ones, the rest in the
        background while the engine serves (jfire.programs.CompiledPrograms). A group's
        follower compiles alike but runs no loop of its own (`run_loop=False`)."""
        t0 = time.perf_counter()
        if self.runner.step_channel is not None:
            self.runner.step_channel.post_config(self)
        if self.config.compilation_cache_dir:  # JAX's persistent cache, before anything compiles
            enable_compilation_cache(self.config.compilation_cache_dir)
        background = self.config.aot and self.config.serve_while_compiling
        self.runner.compile_at_start(self.config, self.connector.side_programs(), background, compile_progress)
        self.startup_s = time.perf_counter() - t0
        if background:
            self._compiler = threading.Thread(target=self._compile_rest, name="jfire-compile-rest", daemon=True)
            self._compiler.start()
        else:
            self.compiled_s = self.startup_s
        self._publish_stats()
        if run_loop:
            self._thread = threading.Thread(target=self._run, name="jfire-engine", daemon=True)
            self._thread.start()
        self.ready.set()
        return self

    def compile_for(self, prompt_len: int, max_tokens: int) -> float:
        """With lazy programs (`aot=False`), compiles the shapes one request of this size alone
        will use, so its timing excludes compilation; returns the seconds spent."""
        return self.runner.compile_for(prompt_len, max_tokens, self.config.prefill_budget)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Blocks until every program is compiled (True), or timeout seconds pass (False)."""
        if self._compiler is not None:
            self._compiler.join(timeout)
            return not self._compiler.is_alive()
        return self.ready.is_set()

    def _compile_rest(self) -> None:
        t0 = time.perf_counter()
        if self.runner.compile_rest(self.config.compile_workers, self._stop, self._wait_idle):
            self.compiled_s = (self.startup_s or 0.0) + time.perf_counter() - t0

    def _wait_idle(self, at_most_s: float = 1.0) -> None:
        """Until no request is queued or running, or `at_most_s` passes: the compiling thread loads
        stored programs between requests (~50 ms of CPU each; on two cores that slowed a running
        request's steps by a third); under steady traffic still one program a second."""
        end = time.perf_counter() + at_most_s
        while (
            (self.outputs.requests or not self._commands.empty())
            and time.perf_counter() < end
            and not self._stop.is_set()
        ):
            time.sleep(0.01)

    def wake(self) -> None:
        """Turns the loop now if it is waiting idle (a connector with work from another thread)."""
        self._commands.put(("wake", None))

    def shutdown(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.runner.step_channel is not None and self.error is None:
            self.runner.step_channel.stop()
        if self._compiler is not None:
            # It stops between compilations: never leave XLA compiling while the process exits.
            self._compiler.join(timeout=120)
        self.connector.shutdown()

    def __enter__(self):
        return self.start() if not self.ready.is_set() else self

    def __exit__(self, *exc):
        self.shutdown()

    def is_ready(self) -> bool:
        return self.ready.is_set()

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) for /health."""
        return serving_health(self.error, self.ready.is_set(), self.programs, self.config.aot)

    # -- the API -------------------------------------------------------------------------------

    def validate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, request_id: str | None = None, kv_params=None
    ) -> None:
        """Raises RequestError (or JfireError) when this request can never run; nothing is queued."""
        self.checks.check(prompt_ids, self.connector.check(request_id, prompt_ids, sampling, kv_params))

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        affinity: str | None = None,
        after: str | None = None,
        kv_params: dict | None = None,
        images=(),
    ) -> RequestHandle:
        """Queues a request; outputs go to the handle's queue, or to `on_output` (called on the
        engine thread: it must not block). `affinity` (a session key) matters only where there
        are several prefill groups to choose from. `after` (a request id with the same prompt,
        n > 1) admits this one once that one's prompt is in the cache, so it reuses its pages.
        `kv_params` is for the KV connector (a split deployment's transfer, its wire split).
        `images`: RequestImages (jfire.vision.encoder) in prompt order, placeholders expanded."""
        if self.error is not None:
            raise EngineStopped(f"the engine has stopped after an error: {self.error}")
        prompt_ids = [int(i) for i in prompt_ids]
        self.validate(prompt_ids, sampling, request_id=request_id, kv_params=kv_params)
        self.checks.admit()
        request_id = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(self, request_id, prompt_ids, self.model.tokenizer is not None)
        seq = Sequence(request_id, prompt_ids, sampling, sampling.resolved_seed())
        seq.images = self.runner.images.for_request(prompt_ids, images)
        seq.after = after  # type: ignore[assignment]  # a request id until the engine thread finds its sequence
        live = self.outputs.new_request(seq, handle, on_output or handle.outputs.put, kv_params)
        self._commands.put(("submit", live))
        return handle

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))

    def fail_all(self, message: str) -> None:
        """Ends every request the engine holds with finish_reason "error" and this message
        (a server shutting down after its grace period)."""
        self._commands.put(("fail_all", message))

    def generate(self, requests: list[tuple[list[int], SamplingParams]]) -> list[Completion]:
        """Runs many requests through the batching engine together and waits for them all."""
        handles = [self.submit(ids, sp) for ids, sp in requests]
        return [h.result() for h in handles]

    def stats(self) -> dict:
        return {**self._stats, **self.connector.stats_now()}

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.runner.step_channel is not None:
                    self.runner.step_channel.beat()
                self._drain_commands(self._idle_wait())
                if self._stop.is_set():
                    break
                self._take_progress(self.connector.update())
                t0 = time.perf_counter()
                step = self.scheduler.schedule()
                self.runner.step_time["schedule"] += time.perf_counter() - t0
                if not step.empty:
                    self._execute(step)
                # Stats first, then outputs: whoever sees a request finish sees its pages freed.
                self._publish_stats()
                self.outputs.deliver()
        except BaseException as e:  # a bug or a device failure: fail every request loudly
            self.error = e
            what = "engine failure" + ("" if self.runner.step_channel is None else " (in a group spanning processes)")
            self._fail_everything(f"{what}: {e}")
            self.outputs.deliver()
            if self.on_fatal is not None:
                self.on_fatal(e)
            raise

    def _fail_everything(self, message: str) -> None:
        for live in [*self.outputs.requests.values(), *self.connector.held_requests()]:
            self.outputs.finish(live, "error", error=message)

    def _idle_wait(self) -> float | None:
        """How long to wait for a command before the next step (None: do not wait)."""
        if self.outputs.requests:
            return None
        return min(0.5, self.connector.poll_interval() or 0.5)

    def _drain_commands(self, wait: float | None) -> None:
        try:
            command = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._command(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _command(self, kind: str, arg) -> None:
        if kind == "submit":
            live: LiveRequest = arg
            if self.connector.loads(live):
                self.connector.hold(live)
                return
            self.outputs.add(live)
            first = self.outputs.requests.get(live.seq.after) if isinstance(live.seq.after, str) else None
            live.seq.after = first.seq if first is not None else None
            try:
                self.scheduler.add(live.seq)
            except Exception as e:
                self.outputs.fail_one(live, e)
        elif kind == "fail_all":
            self._fail_everything(arg)
        elif kind == "cancel":
            if arg in self.outputs.requests:
                self.outputs.finish(self.outputs.requests[arg], "cancelled")
            else:
                self.connector.cancel(arg)

    def _take_progress(self, progress: Progress) -> None:
        """Requests the connector held: those whose KV arrived join the batch with their first
        token; the others end here."""
        for loaded in progress.loaded:
            seq = loaded.live.seq
            seq.computed = len(seq.prompt_ids)
            self.scheduler.add_running(seq)
            self.outputs.add(loaded.live)
            self.outputs.take_tokens({seq: (loaded.first_token, loaded.first_logprobs)})
        for failed in progress.failed:
            failed.live.seq.phase = Phase.FINISHED  # never in the scheduler: nothing to remove there
            self.outputs.finish(failed.live, "cancelled" if failed.error is None else "error", error=failed.error)

    def _on_finished(self, seq: Sequence) -> None:
        if seq.phase is not Phase.FINISHED:
            self.scheduler.finish(seq)
        self.runner.release_slot(seq.request_id)
        self.speculator.finished(seq)

    def _execute(self, step: Step) -> None:
        plan = self.speculator.plan(step.decode, self.programs, self.runner.seconds)
        if plan is None and self._may_run_ahead(step):
            self._decode_running_ahead(step.decode)
            return
        for seq in step.preempted:
            self.runner.release_slot(seq.request_id)
        sampled: dict[Sequence, tuple] = {}
        runs: dict[Sequence, list[tuple]] = {}
        if plan is not None:  # every decode row verifies, with its drafts or none
            runs = self.speculator.verify(plan, step, self.scheduler, self.runner)
        for group in self.runner.decode_groups([seq for seq in step.decode if seq not in runs]):
            sampled.update(zip(group, self.runner.run_decode(group)))
        for chunks in self.runner.prefill_groups(step.prefill):
            results, prompt_logprobs = self.runner.run_prefill(chunks)
            for seq, position, entry in prompt_logprobs:
                self.outputs.keep_prompt_logprob(seq, position, entry)
            sampled.update((c.seq, r) for c, r in zip(chunks, results) if c.completes_prompt)
        self.scheduler.on_step_done(step)
        self._take_tokens(sampled, runs)

    def _take_tokens(self, sampled: dict[Sequence, tuple], runs: dict[Sequence, list[tuple]] | None = None) -> None:
        """Hands each sequence's sampled (token, logprobs entry), and each verified row's run of
        them, to the output processor (in a role ending requests after their prompt: hand-offs)."""
        now = time.perf_counter()
        self._recent.append((now, len(sampled) + sum(map(len, (runs or {}).values()))))
        if self.connector.ends_after_prompt:
            self.outputs.hand_off(sampled, self.connector.request_finished)
        else:
            self.outputs.take_tokens(sampled)
            self.outputs.take_runs(runs or {})
        self.runner.step_time["outputs"] += time.perf_counter() - now
        self.runner.step_time["steps"] += 1

    # -- running ahead: steady decoding with the next step dispatched before the ids are read --

    def _may_run_ahead(self, step: Step) -> bool:
        """Whether the engine may dispatch the step after `step` before reading its ids: a decode-only
        step of every running sequence in one program call, nothing queued that a step between would
        take in, and too many rows to draft (a draft is verified in the step right after its token)."""
        return (
            self.config.run_ahead
            and self.runner.step_channel is None
            and not step.prefill
            and not step.preempted
            and len(step.decode) == len(self.scheduler.running)
            and not self._work_pending()
            and self.programs.decode_shape(len(step.decode)) >= len(step.decode)
            and not self.speculator.may_draft(len(step.decode))
        )

    def _work_pending(self) -> bool:
        """Whether something waits for a step to take it in."""
        return (
            not self._commands.empty()
            or bool(self.scheduler.waiting)
            or self._stop.is_set()
            or self.connector.has_pending()
        )

    def _decode_running_ahead(self, seqs: list[Sequence]) -> None:
        """Decodes `seqs` step after step, dispatching each next step (its tokens: the ids of the
        step in flight, still on the device) before reading the ids of the one in flight, so the
        host's work overlaps the device's. A row the step in flight ends (a stop, a cancel) has
        its next token thrown away. Ends, with no step in flight, once the next step cannot be
        dispatched so (work waiting, the batch shrunk to where it may draft)."""
        runner, timing = self.runner, self.runner.step_time
        t0 = time.perf_counter()
        rows = self.programs.decode_shape(len(seqs))
        in_flight: list[Sequence | None] | None = [*seqs, *[None] * (rows - len(seqs))]
        drafting = False  # the batch may draft (jfire.speculative): the run ends
        _, positions, _, sampling = inputs = runner.decode_inputs(seqs, rows)
        out = runner.decode_call(list(in_flight), rows, inputs)
        timing["prepare"] += time.perf_counter() - t0
        while in_flight is not None:
            t1 = time.perf_counter()
            pending = self._work_pending() or drafting
            following = None if pending else self.scheduler.rows_ahead(in_flight, self.max_model_len)
            ahead = None
            if following is not None:
                goes_on = [s is not None for s in following]
                positions = np.where(goes_on, positions + 1, -1).astype(np.int32)
                slots = np.where(goes_on, sampling.slot, runner.scratch_slot).astype(np.int32)
                sampling = sampling._replace(slot=slots)
                table = runner.row_table(following, rows)
                ahead = runner.decode_call(
                    following, rows, (self.programs.as_input(out.ids), positions, table, sampling)
                )
                timing["run_ahead_steps"] += 1
            t2 = time.perf_counter()
            done = [seq if seq is not None and seq.phase is Phase.RUNNING else None for seq in in_flight]
            results = runner.results(out, done)
            timing["prepare"] += t2 - t1
            timing["device"] += time.perf_counter() - t2
            self.scheduler.on_step_done(Step([seq for seq in done if seq is not None], [], []))
            self._take_tokens({seq: result for seq, result in zip(done, results) if seq is not None})
            going = [s for s in done if s is not None and s.in_decode]
            drafting = self.speculator.may_draft(len(going))
            runner.note_seconds(("decode", rows), time.perf_counter() - t1)
            self._publish_stats()
            self.outputs.deliver()
            self._drain_commands(None)  # cancels take effect; a new request ends the run
            in_flight, out = following, ahead

    def _publish_stats(self) -> None:
        now = time.perf_counter()
        self._recent = [(t, n) for t, n in self._recent if now - t < 10.0]
        window = (now - self._recent[0][0]) if len(self._recent) > 1 else 0.0
        side = self.connector.side_programs()
        self._stats = {
            **self.scheduler.stats(),
            "waiting": len(self.scheduler.waiting) + self._commands.qsize() + self.connector.num_waiting(),
            "tokens_generated": self.outputs.tokens_generated,
            "tokens_per_s": (sum(n for _, n in self._recent[1:]) / window) if window > 0 else 0.0,
            "compiled_programs": self.programs.num_compiled + sum(p.num_compiled for p in side),
            "compiling": self.compiled_s is None,  # serving, with programs still compiling in the background
            **self.runner.step_stats(),
            "startup_s": self.startup_s,
            **self.connector.stats(),
            **self.speculator.stats(),
        }
