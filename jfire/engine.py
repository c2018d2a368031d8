"""The serving engine: continuous batching over AOT-compiled prefill and decode programs.

One thread owns the device state (params, the paged cache) and the scheduler. Callers talk
to it through `submit` / `cancel` / `stats`, which only enqueue commands or read snapshots,
so an HTTP handler never blocks a step and a step never waits on a client.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jfire import sharding
from jfire.checkpoint.load import LoadedModel
from jfire.errors import EngineStopped, JfireError, QueueFull
from jfire.grammar import Grammars, ban, fill_mask
from jfire.kernels import cpu_matmul
from jfire.kv_cache import BlockPool, init_pages, page_bytes
from jfire.pipeline import Pipeline
from jfire.programs import ATTENTION_IMPLS, QUICK_COMPILE, Buckets, CompiledPrograms
from jfire.request_checks import RequestChecks, context_limit
from jfire.requests import Completion, RequestHandle, RequestOutput
from jfire.sampling import PenaltyState, RowSampling, SamplingParams, init_penalty_state, mask_words, set_penalty_slot
from jfire.scheduler import Chunk, Phase, Scheduler, Sequence, Step
from jfire.sharding import to_host
from jfire.tokenizer import find_stop, holdback


def default_compilation_cache_dir() -> str:
    return str(Path.home() / ".cache" / "jfire" / "xla")


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache: a second start-up loads programs instead of compiling."""
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None  # default: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 1 << 30
    max_batch: int = 64
    prefill_budget: int = 256  # prompt tokens per step: bounds how long a step stalls decodes
    max_prefill_rows: int = 16
    max_model_len: int | None = None  # default: the model's context, capped at 4096
    max_waiting: int = 1024
    prefix_caching: bool = True
    attention: str = "reference"
    compile_workers: int = 2
    aot: bool = True  # compile every bucket at start-up; False compiles each on first use
    # Serve once the essential programs exist and compile the rest in the background (with aot).
    serve_while_compiling: bool = True
    # Steady decoding dispatches each step before reading the previous step's ids (the ids
    # stay on the device and feed the next step): the host's work overlaps the device's.
    run_ahead: bool = True
    # On one float32 CPU device, small products read each layer's weights where they lie in the
    # stack (jfire.kernels.cpu_matmul) instead of XLA:CPU copying them out first.
    cpu_matmul: bool = True
    # Compile with XLA's backend optimisation off (programs.QUICK_COMPILE): faster start-up,
    # slower steps. For tiny models and trying things out, not for serving a real model.
    quick_compile: bool = False
    compilation_cache_dir: str | None = None  # JAX's persistent cache; None = off

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLS:
            raise JfireError(f"unknown attention {self.attention!r}; use one of {', '.join(ATTENTION_IMPLS)}")


@dataclasses.dataclass
class _Live:
    """Engine-side state of one request beyond scheduling: its output stream and text."""

    seq: Sequence
    handle: RequestHandle
    on_output: Callable[[RequestOutput], None]
    decoder: object | None
    text: str = ""
    emitted: int = 0  # characters of `text` already sent
    matcher: object | None = None  # the llguidance matcher of a constrained request
    slot: int | None = None  # its PenaltyState slot while it samples with penalties
    prompt_logprobs: list = dataclasses.field(default_factory=list)  # entry p: of prompt token p + 1
    prompt_logprobs_sent: bool = False


class Engine:
    """Colocated serving: prefill and decode programs in one process, one page pool.
    `jfire.disagg` subclasses it for the prefill and decode roles of a split deployment."""

    PROGRAM_KINDS = ("prefill", "decode")
    CALL_KINDS = ("prefill", "decode", "penalty")  # what _apply runs (and a group's followers replay)

    def _uses_cpu_matmul(self, model: LoadedModel) -> bool:
        if not self.config.cpu_matmul or model.mesh is not None or model.dtype_of_params != jnp.float32:
            return False
        device = next(iter(jax.tree.leaves(model.params)[0].devices()))
        return device.platform == "cpu" and cpu_matmul.available()

    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig()):
        self.model = model
        self.cfg = model.config
        self.config = config
        self.max_model_len = context_limit(self.cfg, config.max_model_len)
        dtype = model.dtype_of_params
        mesh = model.mesh
        cache_shardings = sharding.cache_shardings(self.cfg, mesh) if mesh is not None else None
        # kv_cache_bytes is per device: what one page costs on the device holding the most of it.
        per_page = page_bytes(self.cfg, config.page_size, dtype)
        if cache_shardings is not None:
            per_page = sharding.page_bytes_per_device(self.cfg, config.page_size, dtype, cache_shardings)
        num_pages = config.num_pages or max(1, int(config.kv_cache_bytes // per_page))
        max_pages_per_row = -(-self.max_model_len // config.page_size)
        if config.num_pages is None and config.max_batch == 1:
            # One row never holds more than one full context: sized by bytes, a one-row engine
            # (`jfire generate`) would spend the rest on pages that can only keep cached
            # prefixes (a tiny model's 1 GiB default is over a million pages per device).
            num_pages = min(num_pages, max_pages_per_row)
        if cache_shardings is not None:
            # Pages split over devices (an MLA latent cache) come in whole multiples of the split.
            multiple = sharding.page_multiple(cache_shardings, self.cfg)
            num_pages = -(-num_pages // multiple) * multiple
        self.pool = BlockPool(num_pages, config.page_size)
        self.pages = init_pages(self.cfg, num_pages, config.page_size, dtype, cache_shardings)
        layer_stack = None
        if mesh is not None and mesh.shape["pp"] > 1:
            layer_stack = Pipeline(mesh, model.mesh_spec.num_microbatches)
        if mesh is not None and mesh.shape["tp"] > 1 and config.attention != "reference":
            raise JfireError(
                "the Pallas attention kernel runs on one device per tensor-parallel group only; "
                "use --attention reference with tp > 1"
            )
        self.buckets = Buckets.for_limits(
            max_batch=config.max_batch,
            prefill_budget=config.prefill_budget,
            max_prefill_rows=config.max_prefill_rows,
            max_pages_per_row=max_pages_per_row,
            page_size=config.page_size,
        )
        self.scheduler = Scheduler(
            self.pool,
            max_batch=config.max_batch,
            prefill_budget=config.prefill_budget,
            max_prefill_rows=config.max_prefill_rows,
            prefix_caching=config.prefix_caching,
        )
        # One penalty slot per batch row, and a last, scratch, slot for rows without one. The
        # state is committed to the params' device(s) from the start, as every program's output
        # is: `set_penalty_slot` compiled at start-up is then the one later calls use (an
        # uncommitted array is another jit cache entry: the first penalized request compiled it).
        if mesh is not None:
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        else:
            replicated = jax.sharding.SingleDeviceSharding(next(iter(jax.tree.leaves(model.params)[0].devices())))
        self.penalties: PenaltyState = init_penalty_state(config.max_batch + 1, self.cfg.vocab_size, replicated)
        self._scratch_slot = config.max_batch
        self._free_slots = list(range(config.max_batch))
        self._all_allowed: dict[int, np.ndarray] = {}  # rows -> a mask allowing every token
        self.programs = CompiledPrograms(
            self.cfg,
            model.params,
            self.pages,
            self.penalties,
            self.buckets,
            config.attention,
            lazy=not config.aot,
            mesh=mesh,
            layer_stack=layer_stack,
            kinds=self.PROGRAM_KINDS,
            parallel=model.parallel,
            cpu_matmul=self._uses_cpu_matmul(model),
            compiler_options=QUICK_COMPILE if config.quick_compile else None,
        )
        self.eos_ids = frozenset(self.cfg.eos_token_ids) | (model.tokenizer.eos_ids if model.tokenizer else frozenset())
        self.grammars = Grammars(model.tokenizer, self.cfg.vocab_size, self.eos_ids)
        # What a server reads (jfire.client.EngineClient).
        self.tokenizer = model.tokenizer
        self.vocab_size = self.cfg.vocab_size
        self.model_type: str | None = getattr(self.cfg, "model_type", None)
        self.checks = RequestChecks(
            self.cfg.vocab_size,
            self.max_model_len,
            self.grammars,
            model.tokenizer is not None,
            self.scheduler.pages_needed,
            self.pool.num_pages,
        )
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[str, _Live] = {}
        self._outbox: list[tuple[_Live, RequestOutput]] = []  # outputs of this step, sent after stats
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats = {}
        self._tokens_generated = 0
        self._recent: list[tuple[float, int]] = []  # (time, tokens) of recent steps, for tokens/s
        self.ready = threading.Event()
        self.startup_s: float | None = None  # until the engine serves
        self.compiled_s: float | None = None  # until every program is compiled
        self._compiler: threading.Thread | None = None
        # Called (on the engine thread) once the engine has failed for good, after every
        # request it held has been ended: a server stops and exits non-zero.
        self.on_fatal: Callable[[BaseException], None] | None = None
        # Where the engine thread's time goes, summed over steps: the host's scheduling, input
        # building and output handling against the device's programs (`stats()`).
        self._step_time: collections.Counter = collections.Counter()
        self.error: BaseException | None = None
        # A group spanning processes (jfire.lockstep): its leader sends every device call to
        # the followers through this channel before running it.
        self.step_channel = None

    # -- life cycle ----------------------------------------------------------------------------

    def use_compilation_cache(self) -> None:
        """Points JAX at the configured persistent cache: called before anything compiles
        (a subclass compiling its own programs first calls it too)."""
        if self.config.compilation_cache_dir:
            enable_compilation_cache(self.config.compilation_cache_dir)

    def side_programs(self) -> list:
        """Programs a role compiles besides the model's (the KV transfer's gather or insert),
        first, inside start()'s clock and progress."""
        return []

    def start(self, compile_progress: Callable[[int, int], None] | None = None, *, run_loop: bool = True) -> Engine:
        """Compiles the programs ahead of time, then starts the engine thread: every bucket
        first, or with `serve_while_compiling` only the essential ones, the rest in the
        background while the engine serves (jfire.programs.CompiledPrograms). A group's
        follower compiles alike but runs no loop of its own (`run_loop=False`)."""
        t0 = time.perf_counter()
        if self.step_channel is not None:
            self.step_channel.post_config(self)
        self.use_compilation_cache()
        background = self.config.aot and self.config.serve_while_compiling
        shapes = self.programs.essential_shapes() if background else None
        # Progress counts what is compiled before serving: the side programs, then the model's.
        side = self.side_programs()
        num_side = sum(len(p.widths) for p in side)
        total = num_side + ((len(shapes) if background else self.programs.num_total) if self.config.aot else 0)
        done_before = 0
        for programs in side:
            programs.compile_all(
                progress=compile_progress and (lambda done, base=done_before: compile_progress(base + done, total))
            )
            done_before += len(programs.widths)
        if self.config.aot:
            progress = compile_progress and (lambda done, _: compile_progress(num_side + done, total))
            self.programs.compile_all(workers=self.config.compile_workers, progress=progress, shapes=shapes)
        # The penalty-slot update is the one program outside the buckets: compile it now (by
        # running it on the scratch slot), never when a request first asks for penalties.
        # Every process of a group runs start() itself, so this call is not sent to followers.
        vocab = self.cfg.vocab_size
        self._apply("penalty", self._scratch_slot, (np.zeros(vocab, np.int32), np.zeros(vocab, bool)))
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
        will use (its prompt's chunks, one decode row), so its timing excludes compilation;
        returns the seconds spent."""
        t0 = time.perf_counter()
        budget = self.config.prefill_budget
        for start in range(0, prompt_len, budget):
            self.programs.prefill(*self.programs.prefill_shape(min(budget, prompt_len - start), 1))
        if max_tokens > 1:
            self.programs.decode(self.programs.decode_shape(1))
        return time.perf_counter() - t0

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Blocks until every program is compiled (True), or timeout seconds pass (False)."""
        if self._compiler is not None:
            self._compiler.join(timeout)
            return not self._compiler.is_alive()
        return self.ready.is_set()

    def _compile_rest(self) -> None:
        t0 = time.perf_counter()
        try:
            # The lowest CPU priority (Linux: per thread, inherited by the compiling workers it
            # starts), so serving requests is never slowed by compiling programs for later.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        try:
            self.programs.compile_rest(
                workers=self.config.compile_workers, stop=self._stop, before_loading=self._wait_idle
            )
        except Exception as e:  # the essential programs still serve every step, only less tightly
            print(
                f"jfire: compiling the remaining programs failed ({e}); serving with "
                f"{self.programs.num_compiled} of {self.programs.num_total}",
                file=sys.stderr,
                flush=True,
            )
            return
        self.compiled_s = self.startup_s + time.perf_counter() - t0

    def _wait_idle(self, at_most_s: float = 1.0) -> None:
        """Until no request is queued or running, or `at_most_s` passes: the compiling thread
        loads stored programs between requests. Loading one takes ~50 ms of CPU, and on two
        cores it slowed a running request's steps by a third; under steady traffic it still
        proceeds, one program a second."""
        end = time.perf_counter() + at_most_s
        while (self._live or not self._commands.empty()) and time.perf_counter() < end and not self._stop.is_set():
            time.sleep(0.01)

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.step_channel is not None and self.error is None:
            self.step_channel.stop()
        if self._compiler is not None:
            # It stops between compilations: never leave XLA compiling while the process exits.
            self._compiler.join(timeout=120)

    def __enter__(self):
        return self.start() if not self.ready.is_set() else self

    def __exit__(self, *exc):
        self.shutdown()

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) for /health."""
        if self.error is not None:
            return 503, {"status": "error", "message": str(self.error)}
        if not self.ready.is_set():
            return 503, {"status": "starting", "message": "compiling programs"}
        programs = {"compiled": self.programs.num_compiled, "total": self.programs.num_total}
        if self.config.aot and programs["compiled"] < programs["total"]:
            # Serving already, each step with the smallest program compiled so far.
            return 200, {"status": "ok", "compiling": True, "programs": programs}
        return 200, {"status": "ok", "compiling": False, "programs": programs}

    # -- the API -------------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return self.ready.is_set()

    def validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raises RequestError when this request can never run; nothing is queued."""
        self.checks.check(prompt_ids, sampling)

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        affinity: str | None = None,
        after: str | None = None,
    ) -> RequestHandle:
        """Queues a request; outputs go to the handle's queue, or to `on_output` (called on the
        engine thread: it must not block). `affinity` (a session key) matters only where there
        are several prefill groups to choose from. `after` (a request id with the same prompt,
        n > 1) admits this one once that one's prompt is in the cache, so it reuses its pages."""
        if self.error is not None:
            raise EngineStopped(f"the engine has stopped after an error: {self.error}")
        prompt_ids = [int(i) for i in prompt_ids]
        self.validate(prompt_ids, sampling)
        if len(self.scheduler.waiting) + self._commands.qsize() >= self.config.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.config.max_waiting} requests); retry later")
        request_id = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(self, request_id, prompt_ids, self.model.tokenizer is not None)
        seq = Sequence(request_id, prompt_ids, sampling, sampling.resolved_seed())
        seq.after = after
        self._commands.put(("submit", self._new_live(seq, handle, on_output or handle.outputs.put)))
        return handle

    def _new_live(self, seq: Sequence, handle: RequestHandle, on_output) -> _Live:
        sp = seq.sampling
        decoder = (
            self.model.tokenizer.stream_decoder(skip_special_tokens=sp.skip_special_tokens)
            if self.model.tokenizer
            else None
        )
        matcher = self.grammars.matcher(sp.grammar) if sp.grammar is not None else None
        return _Live(seq, handle, on_output, decoder, matcher=matcher)

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
        return dict(self._stats)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.step_channel is not None:
                    self.step_channel.beat()
                self._drain_commands(self._idle_wait())
                if self._stop.is_set():
                    break
                self._between_steps()
                t0 = time.perf_counter()
                step = self.scheduler.schedule()
                self._step_time["schedule"] += time.perf_counter() - t0
                if not step.empty:
                    self._execute(step)
                # Stats first, then outputs: whoever sees a request finish sees its pages freed.
                self._publish_stats()
                self._deliver()
        except BaseException as e:  # a bug or a device failure: fail every request loudly
            self.error = e
            what = "engine failure" if self.step_channel is None else "engine failure (in a group spanning processes)"
            for live in self._all_requests():
                self._finish(live, "error", error=f"{what}: {e}")
            self._deliver()
            if self.on_fatal is not None:
                self.on_fatal(e)
            raise

    def _all_requests(self) -> list[_Live]:
        """Every request the engine holds (to fail them all if the engine itself fails)."""
        return list(self._live.values())

    def _idle_wait(self) -> float | None:
        """How long to wait for a command before the next step (None: do not wait)."""
        return None if self._live else 0.5

    def _between_steps(self) -> None:
        """Work a role does on the engine thread before each step (none when colocated)."""

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

    def _fail_one(self, live: _Live, e: Exception) -> None:
        """Ends one request whose own processing failed; the engine serves the others on."""
        print(f"jfire: request {live.seq.request_id} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if live.seq.request_id in self._live:
            self._finish(live, "error", error=f"request failed: {type(e).__name__}: {e}")

    def _command(self, kind: str, arg) -> None:
        if kind == "submit":
            self._live[arg.seq.request_id] = arg
            first = self._live.get(arg.seq.after) if isinstance(arg.seq.after, str) else None
            arg.seq.after = first.seq if first is not None else None
            try:
                self.scheduler.add(arg.seq)
            except Exception as e:
                self._fail_one(arg, e)
        elif kind == "fail_all":
            for live in self._all_requests():
                self._finish(live, "error", error=arg)
        elif kind == "cancel" and arg in self._live:
            self._finish(self._live[arg], "cancelled")

    def _execute(self, step) -> None:
        if self._may_run_ahead(step):
            self._decode_running_ahead(step.decode)
            return
        for seq in step.preempted:  # it samples again only after recomputing: its slot restarts then
            self._release_slot(self._live[seq.request_id])
        sampled: dict[Sequence, tuple] = {}
        for group in self._decode_groups(step.decode):
            sampled.update(zip(group, self._run_decode(group)))
        for group in self._prefill_groups(step.prefill):
            results = self._run_prefill(group)
            sampled.update((c.seq, r) for c, r in zip(group, results) if c.completes_prompt)
        self.scheduler.on_step_done(step)
        self._take_tokens(sampled)

    def _row_table(self, seqs: list[Sequence | None], rows: int) -> np.ndarray:
        table = np.zeros((rows, self.buckets.pages_per_row), np.int32)
        for r, seq in enumerate(seqs):
            if seq is not None:
                table[r, : len(seq.pages)] = seq.pages
        return table

    def _sampling_rows(self, seqs: list[Sequence], rows: int, sampling_now: list[bool]) -> RowSampling:
        """The rows' sampling inputs; sampling_now[r]: row r's token is kept (a prefill chunk
        that does not end its prompt samples nothing anyone reads)."""
        seeds = np.zeros(rows, np.uint32)
        temperature, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        frequency, presence = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
        repetition = np.ones(rows, np.float32)
        slot = np.full(rows, self._scratch_slot, np.int32)
        logprobs = np.zeros(rows, bool)
        masked = [r for r, seq in enumerate(seqs) if sampling_now[r] and self._needs_mask(seq)]
        allowed = self._masks(rows, masked, seqs)
        for r, seq in enumerate(seqs):
            sp = seq.sampling
            seeds[r], temperature[r], top_k[r], top_p[r] = seq.seed, sp.temperature, sp.top_k, sp.top_p
            if not sampling_now[r]:
                continue
            logprobs[r] = sp.logprobs is not None
            if sp.penalized:
                frequency[r], presence[r], repetition[r] = (
                    sp.frequency_penalty,
                    sp.presence_penalty,
                    sp.repetition_penalty,
                )
                slot[r] = self._slot_of(self._live[seq.request_id])
        return RowSampling(seeds, temperature, top_k, top_p, allowed, frequency, presence, repetition, slot, logprobs)

    def _needs_mask(self, seq: Sequence) -> bool:
        live = self._live[seq.request_id]
        return live.matcher is not None or seq.num_generated < seq.sampling.min_tokens

    def _masks(self, rows: int, masked: list[int], seqs: list[Sequence]) -> np.ndarray:
        if not masked:  # the common case: one shared array, nothing to fill
            if rows not in self._all_allowed:
                self._all_allowed[rows] = np.full((rows, mask_words(self.cfg.vocab_size)), -1, np.int32)
            return self._all_allowed[rows]
        allowed = np.full((rows, mask_words(self.cfg.vocab_size)), -1, np.int32)
        for r in masked:
            seq = seqs[r]
            live = self._live[seq.request_id]
            if live.matcher is not None:
                fill_mask(live.matcher, allowed, r)
            if seq.num_generated < seq.sampling.min_tokens:
                grammar_allows = allowed[r].copy()
                ban(allowed, r, (*self.eos_ids, *seq.sampling.stop_token_ids))
                if not allowed[r].any():  # a complete grammar allows only the end: it wins
                    allowed[r] = grammar_allows
        return allowed

    def _slot_of(self, live: _Live) -> int:
        """The request's penalty slot, started from what it has generated so far."""
        if live.slot is None:
            live.slot = self._free_slots.pop()
            seq, vocab = live.seq, self.cfg.vocab_size
            generated = np.bincount(np.asarray(seq.tokens[len(seq.prompt_ids) :], np.int64), minlength=vocab)
            in_prompt = np.bincount(np.asarray(seq.prompt_ids, np.int64), minlength=vocab) > 0
            self._device_call("penalty", live.slot, (generated[:vocab].astype(np.int32), in_prompt[:vocab]))
        return live.slot

    def _release_slot(self, live: _Live) -> None:
        if live.slot is not None:
            self._free_slots.append(live.slot)
            live.slot = None

    def _decode_groups(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """The step's decode rows in batches that each fit a compiled program (one batch once
        every bucket is compiled; more while start-up compilation is still going)."""
        groups, pending = [], list(seqs)
        while pending:
            rows = self.programs.decode_shape(len(pending))
            groups.append(pending[:rows])
            pending = pending[rows:]
        return groups

    def _run_decode(self, seqs: list[Sequence]) -> list[tuple]:
        t0 = time.perf_counter()
        rows = self.programs.decode_shape(len(seqs))
        return self._on_device(t0, seqs, "decode", (rows,), self._decode_inputs(seqs, rows))[0]

    def _decode_inputs(self, seqs: list[Sequence], rows: int) -> tuple:
        """(tokens, positions, page table, sampling rows) of a decode call: `seqs` in the
        first rows of `rows`, the rest padding (position -1)."""
        tokens = np.zeros(rows, np.int32)
        positions = np.full(rows, -1, np.int32)
        for r, seq in enumerate(seqs):
            tokens[r], positions[r] = seq.tokens[-1], len(seq.tokens) - 1
        sampling = self._sampling_rows(seqs, rows, [True] * len(seqs))
        return tokens, positions, self._row_table(seqs, rows), sampling

    # -- running ahead: steady decoding with the next step dispatched before the ids are read --

    def _may_run_ahead(self, step) -> bool:
        """Whether the engine may dispatch the step after `step` before reading its ids: a
        decode-only step of every running sequence in one program call, with nothing queued
        that a step in between would take in (a subclass adds its own pending work)."""
        return (
            self.config.run_ahead
            and self.step_channel is None
            and not step.prefill
            and not step.preempted
            and len(step.decode) == len(self.scheduler.running)
            and not self._work_pending()
            and self.programs.decode_shape(len(step.decode)) >= len(step.decode)
        )

    def _work_pending(self) -> bool:
        """Whether something waits for a step to take it in (a subclass adds its own)."""
        return not self._commands.empty() or bool(self.scheduler.waiting) or self._stop.is_set()

    def _next_rows(self, rows: list[Sequence | None]) -> list[Sequence | None] | None:
        """The rows of the step after the one in flight, in the same places (a row that the
        step in flight surely ends, by its length, becomes padding), each with pages for one
        more token; None where the next step cannot be dispatched before the ids are read:
        new work is waiting, a row's next token needs a mask built from this one (a grammar,
        min_tokens), no row goes on, or the pool has no page for a row's next token."""
        if self._work_pending():
            return None
        following: list[Sequence | None] = []
        for seq in rows:
            going_on = (
                seq is not None
                and seq.phase is Phase.RUNNING
                and seq.num_generated + 1 < seq.sampling.max_tokens
                and len(seq.tokens) + 1 < self.max_model_len
            )
            if going_on and (
                self._live[seq.request_id].matcher is not None or seq.num_generated + 1 < seq.sampling.min_tokens
            ):
                return None
            following.append(seq if going_on else None)
        if not any(following):
            return None
        for seq in filter(None, following):
            need = self.scheduler.pages_needed(len(seq.tokens) + 1) - len(seq.pages)
            pages = self.pool.allocate(need) if need > 0 else []
            if pages is None:
                return None  # the next normal step preempts as it must
            seq.pages += pages
        return following

    def _decode_running_ahead(self, seqs: list[Sequence]) -> None:
        """Decodes `seqs` step after step, dispatching each next step (its tokens: the ids of
        the step in flight, still on the device) before reading the ids of the one in flight,
        so that the host's scheduling, input building and output handling overlap the
        device's work instead of stalling it. A row the step in flight ends (a stop token, a
        stop string, a cancel) has its next token thrown away: one row of one step wasted.
        Ends, with no step in flight, as soon as the next step cannot be dispatched so."""
        t0 = time.perf_counter()
        rows = self.programs.decode_shape(len(seqs))
        in_flight: list[Sequence | None] = [*seqs, *[None] * (rows - len(seqs))]
        _, positions, _, sampling = inputs = self._decode_inputs(seqs, rows)
        out = self._decode_call(in_flight, (rows,), inputs)
        self._step_time["prepare"] += time.perf_counter() - t0
        while in_flight is not None:
            t1 = time.perf_counter()
            following = self._next_rows(in_flight)
            ahead = None
            if following is not None:
                goes_on = [s is not None for s in following]
                positions = np.where(goes_on, positions + 1, -1).astype(np.int32)
                slots = np.where(goes_on, sampling.slot, self._scratch_slot).astype(np.int32)
                sampling = sampling._replace(slot=slots)
                table = self._row_table(following, rows)
                ahead = self._decode_call(
                    following, (rows,), (self.programs.as_input(out.ids), positions, table, sampling)
                )
                self._step_time["run_ahead_steps"] += 1
            t2 = time.perf_counter()
            done = [seq if seq is not None and seq.phase is Phase.RUNNING else None for seq in in_flight]
            results = self._results(out, done)
            self._step_time["prepare"] += t2 - t1
            self._step_time["device"] += time.perf_counter() - t2
            self.scheduler.on_step_done(Step([seq for seq in done if seq is not None], [], []))
            self._take_tokens({seq: result for seq, result in zip(done, results) if seq is not None})
            self._publish_stats()
            self._deliver()
            self._drain_commands(None)  # cancels take effect; a new request ends the run
            in_flight, out = following, ahead

    def _take_tokens(self, sampled: dict[Sequence, tuple]) -> None:
        """Appends each sequence's sampled (token, logprobs entry) after a step."""
        now = time.perf_counter()
        self._recent.append((now, len(sampled)))
        for seq, (token, logprobs) in sampled.items():
            live = self._live[seq.request_id]
            try:
                self._append(live, token, logprobs)
            except Exception as e:  # this request's own processing (detokenizing, stop strings)
                self._fail_one(live, e)
        self._step_time["outputs"] += time.perf_counter() - now
        self._step_time["steps"] += 1

    def _device_call(self, kind: str, key, inputs):
        """Every device program the engine thread runs goes through here: a group spanning
        processes (jfire.lockstep) sends the call to its followers first, so that every
        process runs the same program on the same inputs."""
        if self.step_channel is not None:
            self.step_channel.send(kind, key, inputs)
        return self._apply(kind, key, inputs)

    def _apply(self, kind: str, key, inputs):
        """Runs one program on this process's state: "decode" (key (rows,)), "prefill"
        (key (rows, tokens)), or "penalty" (key: the slot to start). Returns the
        SampleOut of a decode or prefill."""
        if kind == "penalty":
            self.penalties = set_penalty_slot(self.penalties, key, *inputs)
            return None
        if kind == "decode":
            program = self.programs.decode(*key)
            out, _, self.penalties, self.pages = program(self.model.params, self.pages, *inputs, self.penalties)
        else:
            program = self.programs.prefill(*key)
            *args, targets = inputs
            out, _, self.penalties, self.pages = program(self.model.params, self.pages, *args, self.penalties, targets)
        return out

    def _on_device(self, t0: float, seqs: list[Sequence], kind: str, key, inputs) -> tuple[list[tuple], object]:
        """Runs a program call and waits for its ids, timing the host's preparation since t0
        and the device's part (dispatch to result) for `stats()`. Returns, per row of seqs,
        (token, logprobs entry or None), and the program's SampleOut."""
        t1 = time.perf_counter()
        out = self._decode_call(seqs, key, inputs) if kind == "decode" else self._device_call(kind, key, inputs)
        results = self._results(out, seqs)
        self._step_time["prepare"] += t1 - t0
        self._step_time["device"] += time.perf_counter() - t1
        return results, out

    def _decode_call(self, seqs: list[Sequence | None], key, inputs):
        """Dispatches one decode step of seqs (None: a padding row): the one place both the
        step-by-step and the running-ahead paths run a decode program."""
        return self._device_call("decode", key, inputs)

    def _results(self, out, seqs: list[Sequence | None]) -> list[tuple | None]:
        """Waits for a program's ids and returns, per row of seqs, (token, logprobs entry or
        None), or None for a row without a sequence."""
        ids = to_host(out.ids)
        wanted = [seq.sampling.logprobs if seq is not None else None for seq in seqs]
        if any(k is not None for k in wanted):
            logprob, top_ids, top_lps = to_host(out.logprob), to_host(out.top_ids), to_host(out.top_logprobs)
        results = []
        for r, (seq, k) in enumerate(zip(seqs, wanted)):
            entry = None
            if k is not None:
                top = [[int(i), float(lp)] for i, lp in zip(top_ids[r, :k], top_lps[r, :k]) if np.isfinite(lp)]
                entry = [float(logprob[r]), top]
            results.append((int(ids[r]), entry) if seq is not None else None)
        return results

    def _prefill_groups(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        """Splits a step's chunks into batches that each fit a compiled (rows, tokens) shape."""
        groups, pending = [], sorted(chunks, key=lambda c: -c.length)
        while pending:
            rows, _ = self.programs.prefill_shape(pending[0].length, len(pending))
            groups.append(pending[:rows])
            pending = pending[rows:]
        return groups

    def _run_prefill(self, chunks: list[Chunk]) -> list[tuple]:
        t0 = time.perf_counter()
        rows, t = self.programs.prefill_shape(max(c.length for c in chunks), len(chunks))
        tokens = np.zeros((rows, t), np.int32)
        positions = np.full((rows, t), -1, np.int32)
        last = np.zeros(rows, np.int32)
        for r, c in enumerate(chunks):
            tokens[r, : c.length] = c.seq.tokens[c.start : c.start + c.length]
            positions[r, : c.length] = np.arange(c.start, c.start + c.length)
            last[r] = c.length - 1
        seqs = [c.seq for c in chunks]
        sampling = self._sampling_rows(seqs, rows, [c.completes_prompt for c in chunks])
        targets = self._prompt_targets(chunks, rows, t)
        inputs = (tokens, positions, self._row_table(seqs, rows), last, sampling, targets)
        results, out = self._on_device(t0, seqs, "prefill", (rows, t), inputs)
        if (targets >= 0).any():
            self._keep_prompt_logprobs(chunks, targets, out.prompt)
        return results

    def _prompt_targets(self, chunks: list[Chunk], rows: int, t: int) -> np.ndarray:
        """[rows, t]: the prompt token after each position of rows that want the prompt's logprobs."""
        targets = np.full((rows, t), -1, np.int32)
        for r, c in enumerate(chunks):
            prompt = c.seq.prompt_ids
            if c.seq.sampling.prompt_logprobs:
                for j in range(c.length):
                    if c.start + j + 1 < len(prompt):
                        targets[r, j] = prompt[c.start + j + 1]
        return targets

    def _keep_prompt_logprobs(self, chunks: list[Chunk], targets: np.ndarray, prompt) -> None:
        logprob, top_ids, top_lps = (to_host(x) for x in prompt)
        for r, c in enumerate(chunks):
            live = self._live[c.seq.request_id]
            k = c.seq.sampling.logprobs or 0
            for j in range(c.length):
                position = c.start + j
                # A recompute after preemption runs these positions again: keep the first.
                if targets[r, j] >= 0 and len(live.prompt_logprobs) == position:
                    top = [[int(i), float(lp)] for i, lp in zip(top_ids[r, j, :k], top_lps[r, j, :k])]
                    live.prompt_logprobs.append([float(logprob[r, j]), top])

    # -- outputs -------------------------------------------------------------------------------

    def _append(self, live: _Live, token: int, logprobs: list | None = None) -> None:
        seq, sp = live.seq, live.seq.sampling
        seq.tokens.append(token)
        self._tokens_generated += 1
        finish = None
        ends = (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids
        if live.matcher is not None and not ends:
            # The token came from the matcher's own mask, so it is accepted; a matcher that
            # refuses it has failed (a bug, not the request's fault): the request ends loudly.
            if not live.matcher.consume_token(token):
                raise JfireError(f"constrained decoding failed: {live.matcher.get_error()}")
            if live.matcher.is_stopped():  # the grammar is complete and allows nothing more
                finish = "stop"
        if ends:
            finish = "stop"
        elif finish is None and (seq.num_generated >= sp.max_tokens or len(seq.tokens) >= self.max_model_len):
            finish = "length"
        delta = ""
        if live.decoder is not None and not ends:
            live.text += live.decoder.push(token)
            if finish is not None:
                live.text += live.decoder.flush()
            cut = find_stop(live.text, sp.stop) if sp.stop else None
            if cut is not None:
                live.text, finish = live.text[:cut], "stop"
            safe = len(live.text) if finish or not sp.stop else len(live.text) - holdback(live.text, sp.stop)
            delta, live.emitted = live.text[live.emitted : safe], max(live.emitted, safe)
        elif live.decoder is not None:
            live.text += live.decoder.flush()
            delta, live.emitted = live.text[live.emitted :], len(live.text)
        out = RequestOutput(
            seq.request_id,
            [token],
            delta,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=seq.num_generated,
            prefix_hit_tokens=seq.prefix_hit_tokens,
            logprobs=[logprobs] if logprobs is not None else None,
            prompt_logprobs=self._prompt_logprobs_once(live),
        )
        if finish is not None:
            self._finish(live, finish, last=out)
        else:
            self._outbox.append((live, out))

    def _prompt_logprobs_once(self, live: _Live) -> list | None:
        if not live.seq.sampling.prompt_logprobs or live.prompt_logprobs_sent:
            return None
        live.prompt_logprobs_sent = True
        return live.prompt_logprobs

    def _finish(self, live: _Live, reason: str, *, last: RequestOutput | None = None, error: str | None = None):
        seq = live.seq
        if seq.phase is not Phase.FINISHED:
            self.scheduler.finish(seq)
        self._release_slot(live)
        self._live.pop(seq.request_id, None)
        out = last or RequestOutput(
            seq.request_id,
            [],
            "",
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=seq.num_generated,
            prefix_hit_tokens=seq.prefix_hit_tokens,
        )
        out.finished, out.finish_reason, out.error = True, reason, error
        self._outbox.append((live, out))

    def _deliver(self) -> None:
        outbox, self._outbox = self._outbox, []
        for live, out in outbox:
            try:
                live.on_output(out)
            except Exception as e:  # the request's consumer failed: it can take no more output
                if not out.finished:
                    self.cancel(live.seq.request_id)
                print(
                    f"jfire: request {live.seq.request_id}'s output handler failed: {type(e).__name__}: {e}; "
                    "the request is cancelled",
                    file=sys.stderr,
                    flush=True,
                )

    def _publish_stats(self) -> None:
        now = time.perf_counter()
        self._recent = [(t, n) for t, n in self._recent if now - t < 10.0]
        window = (now - self._recent[0][0]) if len(self._recent) > 1 else 0.0
        pool = self.pool.stats()
        self._stats = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + self._commands.qsize(),
            "pages_total": pool.total,
            "pages_used": pool.used,
            "pages_free": pool.free,
            "pages_cached": pool.cached,
            "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
            "preemptions": self.scheduler.preemptions,
            "prompt_tokens": self.scheduler.prompt_tokens,
            "tokens_generated": self._tokens_generated,
            "tokens_per_s": (sum(n for _, n in self._recent[1:]) / window) if window > 0 else 0.0,
            "compiled_programs": self.programs.num_compiled,
            "compiling": self.compiled_s is None,  # serving, with programs still compiling in the background
            "steps": self._step_time["steps"],
            "run_ahead_steps": self._step_time["run_ahead_steps"],
            **{f"step_{k}_s": self._step_time[k] for k in ("schedule", "prepare", "device", "outputs")},
            "startup_s": self.startup_s,
        }
