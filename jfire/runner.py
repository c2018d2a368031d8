"""The model runner: the device side of an engine.

`ModelRunner` owns what lives on the device (the params, the paged KV cache, the penalty
state) and the compiled programs, builds a step's host inputs (tokens, positions, page
tables, sampling rows, token masks) and runs the programs. Every device call goes through
`call(kind, key, inputs)`: a group spanning processes (jfire.lockstep) sends it to the
followers first, and each follower replays it on its own runner with `apply`, so every
process runs the same program on the same inputs. A KV connector's device work (gathering
pages to send, inserting pages that arrived) joins the same path through `add_calls`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jfire import faults, sharding
from jfire.checkpoint.load import LoadedModel
from jfire.engine_config import MODEL_DRAFTERS
from jfire.errors import JfireError
from jfire.grammar import ban, fill_mask
from jfire.kernels import cpu_matmul
from jfire.kv_cache import KVPools, init_pages, page_bytes, pool_pages
from jfire.models.family import Family
from jfire.pipeline import Pipeline
from jfire.program_inputs import Extras
from jfire.programs import QUICK_COMPILE, Buckets, CompiledPrograms, decode_attention
from jfire.sampling import PenaltyState, RowSampling, init_penalty_state, mask_words, set_penalty_slot
from jfire.scheduler import Chunk, Sequence
from jfire.sharding import to_host
from jfire.speculative.model_drafts import DraftIn, load_draft
from jfire.vision.encoder import ImageEncoder

MODEL_CALLS = ("prefill", "decode", "verify", "penalty")  # the calls every runner has


def load_vision(model: LoadedModel):
    """The model's vision encoder (jfire.vision.model), or None: a text-only model, or one not
    read from a Hugging Face directory (a jfire checkpoint keeps the text model alone)."""
    from jfire.checkpoint.load import resolve_model_path
    from jfire.vision.model import load_vision_model

    path, _ = resolve_model_path(model.name)
    if not path.is_dir():
        return None
    try:
        return load_vision_model(path, model.dtype_of_params, model.tokenizer)
    except JfireError as e:  # the text model still serves; a request with images is refused
        print(f"jfire: {model.name}: images off, its vision side cannot be used: {e}", file=sys.stderr, flush=True)
        return None


def uses_cpu_kernels(model: LoadedModel, wanted: bool) -> bool:
    """The CPU kernels that read weights and pages in place apply: one CPU device computing in
    float32, with float32 or bfloat16 weights (jfire.kernels.cpu_matmul, cpu_attention)."""
    if not wanted or model.mesh is not None or model.kv_dtype != jnp.float32:
        return False
    return model.platform == "cpu" and cpu_matmul.available()


def pool_size(
    cfg: Family, dtype, mesh, config, max_model_len: int, shared: bool = False
) -> tuple[dict[str, int], bool]:
    """(pages per cache group, shared) of the pools of an engine with settings `config` over a
    model of config `cfg` with its KV cache in `dtype` on `mesh` (None: one device): `num_pages`
    each (a windowed group's no more than its rows' windows), else as many as `kv_cache_bytes`
    holds on the device holding the most of a page, split by `jfire.kv_cache.pool_pages`.
    `shared`: one pool for every group, whatever would hold more (a connector moves pages by
    id). `jfire plan` sizes its pools with this too, before any weight is read."""
    groups = cfg.cache_groups()
    cache_shardings = sharding.cache_shardings(cfg, mesh) if mesh is not None else None
    per_page = {
        g.name: (
            sharding.page_bytes_per_device(cfg, config.page_size, dtype, cache_shardings, g.name)
            if cache_shardings is not None
            else page_bytes(cfg, config.page_size, dtype, g.name)
        )
        for g in groups
    }
    rows, step_tokens = config.max_batch, max(config.prefill_budget, 2)
    whole_row = -(-max_model_len // config.page_size)
    if config.num_pages is not None:
        split = not shared and len(groups) > 1 and any(not g.windowed for g in groups)
        counts = {
            g.name: min(config.num_pages, rows * g.pages_per_row(max_model_len, config.page_size, step_tokens))
            if split and g.windowed
            else config.num_pages
            for g in groups
        }
        shared = shared or (len(groups) > 1 and not split)
    else:
        counts, shared = pool_pages(
            groups,
            per_page,
            config.kv_cache_bytes,
            rows=rows,
            max_len=max_model_len,
            page_size=config.page_size,
            step_tokens=step_tokens,
            shared=shared,
        )
        if config.max_batch == 1:
            # One row never holds more than one full context: sized by bytes, a one-row engine
            # (`jfire generate`) would spend the rest on pages that can only keep cached
            # prefixes (a tiny model's 1 GiB default is over a million pages per device).
            counts = {name: min(n, whole_row) for name, n in counts.items()}
    if shared:  # one pool: the same page ids in every array
        counts = dict.fromkeys(counts, max(counts.values()))
    if cache_shardings is not None:
        # Pages split over devices (an MLA latent cache) come in whole multiples of the split.
        multiple = sharding.page_multiple(cache_shardings, cfg)
        counts = {name: -(-n // multiple) * multiple for name, n in counts.items()}
    return counts, shared


class ModelRunner:
    """`program_kinds`: the model programs this engine runs ("prefill", "decode", or both)."""

    def __init__(
        self,
        model: LoadedModel,
        config,
        max_model_len: int,
        eos_ids: frozenset[int],
        program_kinds,
        shared_pool: bool = False,
    ):
        self.model, self.cfg, self.eos_ids = model, model.config, eos_ids
        mesh = model.mesh
        # A draft model run inside the programs (--speculative mtp): its parameters beside the
        # target's, its one-layer cache beside the target's pages, sized with them.
        self.draft, self.params = None, model.params
        if config.speculative in MODEL_DRAFTERS and "decode" in program_kinds:
            self.draft, draft_params = load_draft(model, config)
            self.params = {**model.params, self.draft.PARAMS: draft_params}
            target_bytes = self.cfg.kv_bytes_per_token(model.kv_dtype)
            share = target_bytes / (target_bytes + self.draft.kv_bytes_per_token(model.kv_dtype))
            config = dataclasses.replace(config, kv_cache_bytes=int(config.kv_cache_bytes * share))
        # Pages per cache group, and whether one pool serves every group (`shared_pool`: the
        # engine's connector moves pages by id; see jfire.kv_cache.KVPools).
        self.group_pages, self.shared_pool = pool_size(
            model.config, model.kv_dtype, mesh, config, max_model_len, shared_pool
        )
        cache_shardings = sharding.cache_shardings(self.cfg, mesh) if mesh is not None else None
        self.pages = init_pages(self.cfg, self.group_pages, config.page_size, model.kv_dtype, cache_shardings)
        if self.draft is not None:
            pages = self.group_pages[self.cfg.cache_groups()[0].name]
            arrays = self.draft.cache_arrays(pages, config.page_size, model.kv_dtype)
            if mesh is not None:  # a small layer's cache: whole on every device
                arrays = jax.device_put(arrays, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
            self.pages.update(arrays)
        self.pools = KVPools(self.cfg.cache_groups(), self.group_pages, config.page_size, self.shared_pool)
        self.images = ImageEncoder(load_vision(model) if "prefill" in program_kinds else None)
        # The page table of a program: each cache group's table side by side, in the order of
        # `cache_groups()`, each column block naming its pool (the same one, when shared).
        self.table_pools = [self.pools.index[g.name] for g in self.cfg.cache_groups()]
        layer_stack = (
            Pipeline(mesh, model.mesh_spec.num_microbatches) if mesh is not None and mesh.shape["pp"] > 1 else None
        )
        decode_attention(config.attention, mesh)  # refused here, before anything compiles
        self.buckets = Buckets.for_limits(
            max_batch=config.max_batch,
            prefill_budget=config.prefill_budget,
            max_prefill_rows=config.max_prefill_rows,
            max_pages_per_row=-(-max_model_len // config.page_size),
            page_size=config.page_size,
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
        self.scratch_slot = config.max_batch
        self._free_slots = list(range(config.max_batch))
        self._slots: dict[str, int] = {}  # request id -> its penalty slot while it samples with penalties
        self._all_allowed: dict[int, np.ndarray] = {}  # rows -> a mask allowing every token
        self.programs = CompiledPrograms(
            self.cfg,
            self.params,
            self.pages,
            self.penalties,
            self.buckets,
            config.attention,
            lazy=not config.aot,
            mesh=mesh,
            layer_stack=layer_stack,
            kinds=program_kinds,
            parallel=model.parallel,
            cpu_matmul=uses_cpu_kernels(model, config.cpu_kernels),
            compiler_options=QUICK_COMPILE if config.quick_compile else None,
            verify_tokens=config.num_draft_tokens + 1 if config.speculative else 0,
            verify_rows=config.speculative_max_rows,
            draft=self.draft,
            embeds_width=getattr(self.cfg, "hidden_size", 0) if self.images.vision is not None else 0,
        )
        self._calls: dict[str, Callable] = {}  # a connector's device calls, by kind
        # A group spanning processes (jfire.lockstep): the leader sends every device call to
        # the followers through this channel before running it.
        self.step_channel = None
        # Where the engine thread's time goes, summed over steps: the host's input building
        # against the device's programs (the engine adds scheduling and output handling).
        self.step_time: collections.Counter = collections.Counter()
        self.seconds: dict[tuple, float] = {}  # (kind, shape) -> a step's seconds, averaged (note_seconds)
        self._timed_once: set[tuple] = set()

    # -- device calls --------------------------------------------------------------------------

    @property
    def call_kinds(self) -> tuple[str, ...]:
        """Every kind of call `apply` runs (what a group's followers may be sent)."""
        return MODEL_CALLS + tuple(self._calls)

    def add_calls(self, calls: dict[str, Callable]) -> None:
        """A connector's device work, run as `fn(key, inputs)` on every process of a group."""
        self._calls.update(calls)

    def call(self, kind: str, key, inputs):
        """Every device program the engine thread runs goes through here: a group spanning
        processes sends the call to its followers first."""
        if self.step_channel is not None:
            self.step_channel.send(kind, key, inputs)
        return self.apply(kind, key, inputs)

    def apply(self, kind: str, key, inputs):
        """Runs one call on this process's state: "decode" (key (rows,)), "prefill" or "verify"
        (key (rows, tokens)), "penalty" (key: the slot to start), or a connector's. Returns the
        SampleOut of a decode or prefill, the VerifyOut of a verify, or what the connector's
        call returns."""
        if kind == "penalty":
            self.penalties = set_penalty_slot(self.penalties, key, *inputs)
            return None
        # The inputs before the penalty state, then those after it (a prefill's prompt targets,
        # a draft model's inputs).
        if kind == "decode":
            program = self.programs.decode(*key)
            out, _, self.penalties, self.pages = program(
                self.params, self.pages, *inputs[:4], self.penalties, *inputs[4:]
            )
            return out
        if kind == "verify":
            program = self.programs.verify(*key)
            out, self.penalties, self.pages = program(self.params, self.pages, *inputs[:5], self.penalties, *inputs[5:])
            return out
        if kind == "prefill":
            program = self.programs.prefill(*key)
            out, _, self.penalties, self.pages = program(
                self.params, self.pages, *inputs[:5], self.penalties, *inputs[5:]
            )
            return out
        return self._calls[kind](key, inputs)

    def compile_penalty_update(self) -> None:
        """The penalty-slot update is the one program outside the buckets: compiled by running
        it on the scratch slot, never when a request first asks for penalties. Every process
        of a group runs this itself, so it is not sent to followers."""
        vocab = self.cfg.vocab_size
        self.apply("penalty", self.scratch_slot, (np.zeros(vocab, np.int32), np.zeros(vocab, bool)))

    def decode_call(self, seqs: list[Sequence | None], rows: int, inputs):
        """Dispatches one decode step of seqs (None: a padding row): the one place both the
        step-by-step and the running-ahead paths run a decode program."""
        if faults.before_decode is not None:
            faults.before_decode(seqs)
        return self.call("decode", (rows,), inputs)

    # -- compiling -----------------------------------------------------------------------------

    def compile_at_start(self, config, side: list, background: bool, progress=None) -> None:
        """Compiles (or loads) what serving needs first: the connector's `side` programs, then
        with `config.aot` every bucket, or with `background` only the essential ones (the
        rest: `compile_rest`), then the penalty update. `progress(done, total)` after each."""
        shapes = self.programs.essential_shapes() if background else None
        num_side = sum(len(p.widths) for p in side)
        total = num_side + ((len(shapes) if shapes is not None else self.programs.num_total) if config.aot else 0)
        done_before = 0
        for programs in side:
            programs.compile_all(progress=progress and (lambda done, base=done_before: progress(base + done, total)))
            done_before += len(programs.widths)
        if config.aot:
            model_progress = progress and (lambda done, _: progress(num_side + done, total))
            self.programs.compile_all(workers=config.compile_workers, progress=model_progress, shapes=shapes)
            if not background:
                self.images.warm_up()
        self.compile_penalty_update()

    def compile_rest(self, workers: int, stop, before_loading) -> bool:
        """Compiles the buckets `compile_at_start` left, in the background; False if that failed
        (the essential programs still serve every step, only less tightly)."""
        try:
            # The lowest CPU priority (Linux: per thread, inherited by the compiling workers it
            # starts), so serving requests is never slowed by compiling programs for later.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        try:
            self.programs.compile_rest(workers=workers, stop=stop, before_loading=before_loading)
            self.images.warm_up(stop)
        except Exception as e:
            print(
                f"jfire: compiling the remaining programs failed ({e}); serving with "
                f"{self.programs.num_compiled} of {self.programs.num_total}",
                file=sys.stderr,
                flush=True,
            )
            return False
        return True

    def compile_for(self, prompt_len: int, max_tokens: int, budget: int) -> float:
        """With lazy programs, compiles the shapes one request of this size alone will use (its
        prompt's chunks, one decode row); returns the seconds spent."""
        t0 = time.perf_counter()
        for start in range(0, prompt_len, budget):
            self.programs.prefill(*self.programs.prefill_shape(min(budget, prompt_len - start), 1))
        if max_tokens > 1:
            self.programs.decode(self.programs.decode_shape(1))
        return time.perf_counter() - t0

    # -- steps ---------------------------------------------------------------------------------

    def decode_groups(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """The step's decode rows in batches that each fit a compiled program (one batch once
        every bucket is compiled; more while start-up compilation is still going)."""
        groups, pending = [], list(seqs)
        while pending:
            rows = self.programs.decode_shape(len(pending))
            groups.append(pending[:rows])
            pending = pending[rows:]
        return groups

    def prefill_groups(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        """Splits a step's chunks into batches that each fit a compiled (rows, tokens) shape."""
        groups, pending = [], sorted(chunks, key=lambda c: -c.length)
        while pending:
            rows, _ = self.programs.prefill_shape(pending[0].length, len(pending))
            groups.append(pending[:rows])
            pending = pending[rows:]
        return groups

    def run_decode(self, seqs: list[Sequence]) -> list[tuple]:
        """One decode call of seqs; per row, (token, logprobs entry or None)."""
        t0 = time.perf_counter()
        rows = self.programs.decode_shape(len(seqs))
        inputs = self.decode_inputs(seqs, rows)
        results = self._timed(t0, lambda: self.decode_call(list(seqs), rows, inputs), seqs)[0]
        self.note_seconds(("decode", rows), time.perf_counter() - t0)
        return results

    def run_prefill(self, chunks: list[Chunk]) -> tuple[list[tuple], list[tuple]]:
        """One prefill call of chunks: per row, (token, logprobs entry or None), and the prompt
        logprobs asked for, as (seq, position, entry) with entry of prompt token position + 1."""
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
        sampling = self.sampling_rows(seqs, rows, [c.completes_prompt for c in chunks])
        targets = self._prompt_targets(chunks, rows, t)
        inputs = (tokens, positions, self.row_table(seqs, rows), last, sampling, targets)
        draft_in = embeds = None
        if self.draft is not None:
            following = np.full((rows, t), -1, np.int32)  # -1: the token sampled there
            for r, c in enumerate(chunks):
                known = c.seq.tokens[c.start + 1 : c.start + c.length + 1]
                following[r, : len(known)] = known
            draft_in = self.draft_inputs(seqs, rows, following)
        if self.programs.embeds_width:
            embeds = self.images.chunk_embeds(chunks, rows, t, self.programs.embeds_width)
        if draft_in is not None or embeds is not None:
            inputs += (Extras(draft_in, embeds),)
        results, out = self._timed(t0, lambda: self.call("prefill", (rows, t), inputs), seqs)
        return results, (self._prompt_logprobs(chunks, targets, out.prompt) if (targets >= 0).any() else [])

    def run_verify(self, seqs: list[Sequence], drafts: list[list[int]], shape: tuple[int, int]) -> list[list[tuple]]:
        """One verify call (jfire.speculative.verify) of program `shape` (rows, tokens) of seqs,
        each with its drafts (its pages already reach its last draft's position); per row, the
        emitted (token, logprobs entry or None) pairs: the accepted drafts, then the model's own
        next token."""
        t0 = time.perf_counter()
        rows, t = shape
        tokens = np.zeros((rows, t), np.int32)
        positions = np.full((rows, t), -1, np.int32)
        num_drafts = np.zeros(rows, np.int32)
        for r, (seq, draft) in enumerate(zip(seqs, drafts)):
            row = [seq.tokens[-1], *draft]
            tokens[r, : len(row)] = row
            positions[r, : len(row)] = np.arange(len(seq.tokens) - 1, len(seq.tokens) - 1 + len(row))
            num_drafts[r] = len(draft)
        sampling = self.sampling_rows(seqs, rows, [True] * len(seqs))
        sampling = sampling._replace(allowed=self._verify_masks(seqs, drafts, rows, t))  # type: ignore[arg-type]
        inputs = (tokens, positions, self.row_table(list(seqs), rows), num_drafts, sampling)
        if self.draft is not None:
            inputs += (Extras(self.draft_inputs(seqs, rows, np.full((rows, t), -1, np.int32))),)
        results, _ = self._timed(t0, lambda: self.call("verify", (rows, t), inputs), seqs, self._verify_results(seqs))
        self.note_seconds(("verify", rows, t), time.perf_counter() - t0)
        return results

    def _verify_results(self, seqs: list[Sequence]) -> Callable:
        """Reads a VerifyOut: per row of seqs, its emitted (token, logprobs entry or None) pairs."""

        def read(out) -> list[list[tuple]]:
            ids, emitted = to_host(out.ids), to_host(out.emitted)
            self.keep_drafts(out, list(seqs))
            wanted = [seq.sampling.logprobs for seq in seqs]
            if any(k is not None for k in wanted):
                logprob, top_ids, top_lps = to_host(out.logprob), to_host(out.top_ids), to_host(out.top_logprobs)
            results = []
            for r, k in enumerate(wanted):
                run = []
                for j in range(int(emitted[r])):
                    entry = None if k is None else logprobs_entry(logprob[r, j], top_ids[r, j], top_lps[r, j], k)
                    run.append((int(ids[r, j]), entry))
                results.append(run)
            return results

        return read

    def note_seconds(self, key: tuple, seconds: float) -> None:
        """A step of program `key` took `seconds` (all its host and device work): kept as a
        moving average, what the speculator weighs a verify step against decoding with. A
        program's first step is not counted: it may have compiled or loaded the program."""
        if key not in self._timed_once:
            self._timed_once.add(key)
            return
        before = self.seconds.get(key)
        self.seconds[key] = seconds if before is None else 0.8 * before + 0.2 * seconds

    def _verify_masks(self, seqs: list[Sequence], drafts: list[list[int]], rows: int, t: int) -> np.ndarray:
        """[rows, t, words]: the mask of each verify position, as decode would build it after the
        drafts before it (a grammar advanced through them, then rolled back; EOS banned while
        min_tokens is not reached). The drafts are ones the grammar accepts."""
        words = mask_words(self.cfg.vocab_size)  # type: ignore[attr-defined]  # every family has one
        allowed = np.full((rows, t, words), -1, np.int32)
        for r, (seq, draft) in enumerate(zip(seqs, drafts)):
            if not needs_mask(seq) and seq.num_generated + len(draft) >= seq.sampling.min_tokens:
                continue
            matcher, consumed = seq.matcher, 0
            for j in range(len(draft) + 1):
                live = matcher if matcher is not None and not matcher.is_stopped() else None  # type: ignore[attr-defined]
                self._fill_mask_row(allowed[r], j, seq, seq.num_generated + j, live)
                if j < len(draft) and matcher is not None:
                    if not matcher.consume_token(draft[j]):  # type: ignore[attr-defined]
                        break
                    consumed += 1
            if consumed:
                matcher.rollback(consumed)  # type: ignore[attr-defined]
        return allowed

    def _timed(self, t0: float, dispatch: Callable, seqs: list, read: Callable | None = None) -> tuple[list, object]:
        """Runs a call and waits for its ids (`read(out)`, by default `results(out, seqs)`),
        timing the host's preparation since t0 and the device's part (dispatch to result)."""
        t1 = time.perf_counter()
        out = dispatch()
        results = read(out) if read is not None else self.results(out, seqs)
        self.step_time["prepare"] += t1 - t0
        self.step_time["device"] += time.perf_counter() - t1
        return results, out

    def results(self, out, seqs: list[Sequence | None]) -> list:
        """Waits for a program's ids and returns, per row of seqs, (token, logprobs entry or
        None), or None for a row without a sequence."""
        ids = to_host(out.ids)
        self.keep_drafts(out, seqs)
        wanted = [seq.sampling.logprobs if seq is not None else None for seq in seqs]
        if any(k is not None for k in wanted):
            logprob, top_ids, top_lps = to_host(out.logprob), to_host(out.top_ids), to_host(out.top_logprobs)
        results: list = []
        for r, (seq, k) in enumerate(zip(seqs, wanted)):
            entry = None if k is None else logprobs_entry(logprob[r], top_ids[r], top_lps[r], k)
            results.append((int(ids[r]), entry) if seq is not None else None)
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

    def _prompt_logprobs(self, chunks: list[Chunk], targets: np.ndarray, prompt) -> list[tuple]:
        logprob, top_ids, top_lps = (to_host(x) for x in prompt)
        entries = []
        for r, c in enumerate(chunks):
            k = c.seq.sampling.logprobs or 0
            for j in range(c.length):
                if targets[r, j] >= 0:
                    top = [[int(i), float(lp)] for i, lp in zip(top_ids[r, j, :k], top_lps[r, j, :k])]
                    entries.append((c.seq, c.start + j, [float(logprob[r, j]), top]))
        return entries

    # -- inputs --------------------------------------------------------------------------------

    def decode_inputs(self, seqs: list[Sequence], rows: int) -> tuple:
        """(tokens, positions, page table, sampling rows) of a decode call: `seqs` in the
        first rows of `rows`, the rest padding (position -1)."""
        tokens = np.zeros(rows, np.int32)
        positions = np.full(rows, -1, np.int32)
        for r, seq in enumerate(seqs):
            tokens[r], positions[r] = seq.tokens[-1], len(seq.tokens) - 1
        sampling = self.sampling_rows(seqs, rows, [True] * len(seqs))
        if self.draft is not None:
            draft_in = self.draft_inputs(seqs, rows, np.full((rows, 1), -1, np.int32))
            return tokens, positions, self.row_table(seqs, rows), sampling, Extras(draft_in)
        return tokens, positions, self.row_table(seqs, rows), sampling

    def draft_inputs(self, seqs: list[Sequence], rows: int, following: np.ndarray) -> DraftIn:
        """A draft model's inputs: the token after each position (-1: the one the step samples
        there) and how far each row's pages reach."""
        room = np.zeros(rows, np.int32)
        for r, seq in enumerate(seqs):
            room[r] = len(seq.tables[0]) * self.pools.page_size
        return DraftIn(following, room)

    def keep_drafts(self, out, seqs: list[Sequence | None]) -> None:
        """Hands a draft model's drafts (a program's `drafts`, -1 past each row's end) to the
        rows' sequences, for the speculator's next plan."""
        if getattr(out, "drafts", None) is None:
            return
        drafts = to_host(out.drafts)
        for r, seq in enumerate(seqs):
            if seq is not None:
                row = drafts[r].tolist()
                seq.model_draft = row[: row.index(-1)] if -1 in row else row

    @property
    def num_pages(self) -> int:
        """Pages of the first cache group's pool (all of them, when the groups share one)."""
        return self.group_pages[self.cfg.cache_groups()[0].name]

    def row_table(self, seqs: list[Sequence | None], rows: int) -> np.ndarray:
        """[rows, groups x width]: each row's pages in each cache group (pages a window left
        behind, and columns past the row, read as page 0: no query sees them)."""
        w = self.buckets.pages_per_row
        table = np.zeros((rows, len(self.table_pools) * w), np.int32)
        for r, seq in enumerate(seqs):
            if seq is not None:
                for g, i in enumerate(self.table_pools):
                    pages = seq.tables[i]
                    table[r, g * w : g * w + len(pages)] = pages
        np.maximum(table, 0, out=table)
        return table

    def sampling_rows(self, seqs: list[Sequence], rows: int, sampling_now: list[bool]) -> RowSampling:
        """The rows' sampling inputs; sampling_now[r]: row r's token is kept (a prefill chunk
        that does not end its prompt samples nothing anyone reads)."""
        seeds = np.zeros(rows, np.uint32)
        temperature, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        frequency, presence = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
        repetition = np.ones(rows, np.float32)
        slot = np.full(rows, self.scratch_slot, np.int32)
        logprobs = np.zeros(rows, bool)
        masked = [r for r, seq in enumerate(seqs) if sampling_now[r] and needs_mask(seq)]
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
                slot[r] = self._slot_of(seq)
        return RowSampling(seeds, temperature, top_k, top_p, allowed, frequency, presence, repetition, slot, logprobs)

    def _masks(self, rows: int, masked: list[int], seqs: list[Sequence]) -> np.ndarray:
        if not masked:  # the common case: one shared array, nothing to fill
            if rows not in self._all_allowed:
                self._all_allowed[rows] = np.full((rows, mask_words(self.cfg.vocab_size)), -1, np.int32)
            return self._all_allowed[rows]
        allowed = np.full((rows, mask_words(self.cfg.vocab_size)), -1, np.int32)
        for r in masked:
            self._fill_mask_row(allowed, r, seqs[r], seqs[r].num_generated, seqs[r].matcher)
        return allowed

    def _fill_mask_row(self, allowed: np.ndarray, row: int, seq: Sequence, generated: int, matcher) -> None:
        """Row `row` of allowed [rows, words]: what `matcher` allows next (None: any token), with
        EOS and the request's stop ids banned while `generated` is under its min_tokens."""
        if matcher is not None:
            fill_mask(matcher, allowed, row)
        if generated < seq.sampling.min_tokens:
            grammar_allows = allowed[row].copy()
            ban(allowed, row, (*self.eos_ids, *seq.sampling.stop_token_ids))
            if not allowed[row].any():  # a complete grammar allows only the end: it wins
                allowed[row] = grammar_allows

    def _slot_of(self, seq: Sequence) -> int:
        """The request's penalty slot, started from what it has generated so far."""
        slot = self._slots.get(seq.request_id)
        if slot is None:
            slot = self._slots[seq.request_id] = self._free_slots.pop()
            vocab = self.cfg.vocab_size
            generated = np.bincount(np.asarray(seq.tokens[len(seq.prompt_ids) :], np.int64), minlength=vocab)
            in_prompt = np.bincount(np.asarray(seq.prompt_ids, np.int64), minlength=vocab) > 0
            self.call("penalty", slot, (generated[:vocab].astype(np.int32), in_prompt[:vocab]))
        return slot

    def step_stats(self) -> dict:
        t = self.step_time
        return {
            "steps": t["steps"],
            "run_ahead_steps": t["run_ahead_steps"],
            **{f"step_{k}_s": t[k] for k in ("schedule", "prepare", "device", "outputs")},
            **self.images.stats(),
        }

    def release_slot(self, request_id: str) -> None:
        """The request ended, or was preempted: it samples again only after recomputing, and
        its slot restarts then."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)


def logprobs_entry(logprob, top_ids, top_logprobs, k: int) -> list:
    """A sampled token's logprobs entry: [its logprob, [[id, logprob] of the k most likely]]."""
    top = [[int(i), float(lp)] for i, lp in zip(top_ids[:k], top_logprobs[:k]) if np.isfinite(lp)]
    return [float(logprob), top]


def needs_mask(seq: Sequence) -> bool:
    """Whether the sequence's next token is sampled under a mask built from its state (a
    grammar, or min_tokens not yet reached)."""
    return seq.matcher is not None or seq.num_generated < seq.sampling.min_tokens
