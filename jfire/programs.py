"""The compiled programs: prefill and decode, each a pure function jitted on its own.

Prefill is compute-bound (chunks of prompt tokens in one pass); decode is memory-bound (one
token per sequence, reading its cache). Both write the paged cache they are given, which is
donated so XLA updates it in place, and both sample on the device so only the new ids cross
back to the host.

`attention` is "reference" (plain jnp, the CPU default) or "pallas" / "pallas-interpret"
(the Pallas kernels: decode steps and prefill chunks).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jfire import compile_cache
from jfire.attention import PallasAttention, decode_attention
from jfire.kernels import cpu_matmul as cpu_matmul_kernels
from jfire.models.family import Family
from jfire.program_inputs import Extras
from jfire.sampling import PenaltyState, RowSampling, mask_words, prompt_logprobs, sample
from jfire.speculative.model_drafts import DraftIn, capturing
from jfire.speculative.verify import verify

__all__ = ["PallasAttention", "decode_attention"]  # chosen in jfire.attention, imported from here too

# Compiler options of a quick compile (EngineConfig.quick_compile): XLA's backend (LLVM)
# optimisation off. A tiny model's programs compile about 3x faster on this CPU; the default
# model's steps run about half as fast (docs/performance.md, "Quick compiles").
QUICK_COMPILE = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The padded shapes programs are compiled for: decode rows, and prefill (rows, tokens).

    The page table has no bucket: every program takes it `pages_per_row` wide (the whole
    context), and attention reads only as far as the step's longest row (see
    jfire.kernels.paged_attention), so the context length adds no programs."""

    decode_batches: tuple[int, ...]
    prefill_shapes: tuple[tuple[int, int], ...]  # (rows, tokens per row)
    pages_per_row: int

    @classmethod
    def for_limits(
        cls, *, max_batch: int, prefill_budget: int, max_prefill_rows: int, max_pages_per_row: int, page_size: int
    ) -> Buckets:
        decode = powers(1, max_batch, 2)
        # Chunk lengths in powers of two (a chunk pads to at most twice its tokens). Rows per
        # length: 1, 4, and as many as fill the step's budget, so a step of equal chunks
        # (say 2 x 128 of a 256 budget) runs as one full program.
        shapes = []
        for t in powers(16, max(prefill_budget, 16), 2):
            fill = max(1, min(max_prefill_rows, prefill_budget // t))
            for r in sorted({1, fill, *(r for r in (4,) if r <= fill)}):
                shapes.append((r, t))
        return cls(tuple(decode), tuple(shapes), max_pages_per_row)

    def decode_batch(self, n: int) -> int:
        return _smallest_at_least(self.decode_batches, n, "decode batch")

    def prefill_token_buckets(self) -> list[int]:
        return sorted({t for _, t in self.prefill_shapes})

    def max_rows_for(self, tokens: int) -> int:
        return max(r for r, t in self.prefill_shapes if t == tokens)

    def prefill_rows(self, tokens: int, n: int) -> int:
        return _smallest_at_least(sorted(r for r, t in self.prefill_shapes if t == tokens), n, "prefill rows")


def powers(lo: int, hi: int, base: int) -> list[int]:
    """lo, lo * base, ... below hi, then hi."""
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= base
    return out + [hi]


def _smallest_at_least(options, n: int, what: str) -> int:
    for x in options:
        if x >= n:
            return x
    raise ValueError(f"{what} {n} exceeds the largest compiled bucket {max(options)}")


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "attention", "layer_stack", "parallel", "cpu_matmul", "draft"),
    donate_argnames=("pages", "penalties"),
)
def prefill(
    params,
    pages,
    tokens,
    positions,
    page_table,
    last_index,
    rows: RowSampling,
    penalties: PenaltyState,
    targets,
    extras: Extras | None = None,
    *,
    cfg: Family,
    attention: str = "reference",
    layer_stack=None,
    parallel=None,
    cpu_matmul: bool = False,
    draft=None,
):
    """Chunks of prompts: tokens/positions [b, t] (position -1 = padding), page_table [b, groups x w];
    last_index [b] picks the token whose next-token logits are wanted; targets [b, t] the
    prompt token after each position whose logprob is wanted (-1: none, the usual case).
    Returns (SampleOut of the next ids with the prompt's logprobs, their logits [b, v],
    penalties, pages). `cpu_matmul`: small products read the weights in place
    (jfire.kernels.cpu_matmul; one CPU device computing in float32 only). `extras`: image rows
    in place of token embeddings, and the inputs of `draft`, a draft model run after the step
    (jfire.speculative.model_drafts; the SampleOut then carries its drafts)."""
    draft_in, embeds = extras if extras is not None else (None, None)
    with cpu_matmul_kernels.in_place(cpu_matmul), capturing(draft) as captured:
        hidden, pages = cfg.decoder(
            params,
            tokens,
            positions,
            pages,
            page_table,
            attention_impl=decode_attention(attention),
            layer_stack=layer_stack,
            parallel=parallel,
            **({"embeds": embeds} if embeds is not None else {}),
        )
        row = jnp.arange(tokens.shape[0])
        logits = cfg.logits(params, hidden[row, last_index])
        steps = positions[row, last_index].astype(jnp.uint32)
        out, penalties = sample(logits, steps, rows, penalties)
        out = out._replace(prompt=prompt_logprobs(functools.partial(cfg.logits, params), hidden, targets))
    if draft is not None:
        drafts, pages = draft(
            params,
            pages,
            draft.target_hidden(params, hidden, captured),
            draft_in,
            out.ids,
            positions,
            last_index,
            page_table,
            decode_attention(attention),
            parallel,
        )
        out = out._replace(drafts=drafts)
    return out, logits, penalties, pages


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "attention", "layer_stack", "parallel", "cpu_matmul", "draft"),
    donate_argnames=("pages", "penalties"),
)
def decode(
    params,
    pages,
    tokens,
    positions,
    page_table,
    rows: RowSampling,
    penalties: PenaltyState,
    extras: Extras | None = None,
    *,
    cfg: Family,
    attention: str = "reference",
    layer_stack=None,
    parallel=None,
    cpu_matmul: bool = False,
    draft=None,
):
    """One token per row: tokens/positions [b] (position -1 = an empty row), page_table [b, groups x w].
    Returns (SampleOut of the next ids, logits [b, v], penalties, pages); `draft` as for prefill."""
    draft_in = extras.draft if extras is not None else None
    with cpu_matmul_kernels.in_place(cpu_matmul), capturing(draft) as captured:
        hidden, pages = cfg.decoder(
            params,
            tokens[:, None],
            positions[:, None],
            pages,
            page_table,
            attention_impl=decode_attention(attention),
            layer_stack=layer_stack,
            parallel=parallel,
        )
        logits = cfg.logits(params, hidden[:, 0])
    out, penalties = sample(logits, positions.astype(jnp.uint32), rows, penalties)
    if draft is not None:
        first = jnp.zeros(tokens.shape, jnp.int32)
        drafts, pages = draft(
            params,
            pages,
            draft.target_hidden(params, hidden, captured),
            draft_in,
            out.ids,
            positions[:, None],
            first,
            page_table,
            decode_attention(attention),
            parallel,
        )
        out = out._replace(drafts=drafts)
    return out, logits, penalties, pages


class CompiledPrograms:
    """Every bucket of prefill and decode, compiled ahead of time (`lower(...).compile()`, or
    loaded by `jfire.compile_cache` where JAX's persistent cache does not serve the process).

    Serving only ever calls these executables, so a shape outside the table is an error,
    never a silent compilation in the middle of traffic.

    Start-up compiles the essential programs first: one decode row, and one prefill row of
    the fewest tokens and one of the full token budget, which together run any step (a step
    with more rows runs as several calls). The engine serves as soon as they exist; the other
    buckets compile in the background, smallest first, and each step uses the smallest
    compiled program that holds it (`decode_shape`, `prefill_shape`), so shapes only get
    tighter as compilation proceeds. Compiled tables are replaced, never mutated, so the engine thread
    reads them while the compiling thread adds to them.
    """

    def __init__(
        self,
        cfg: Family,
        params,
        pages,
        penalties,
        buckets: Buckets,
        attention: str = "reference",
        lazy: bool = False,
        mesh=None,
        layer_stack=None,
        kinds=("prefill", "decode"),
        parallel=None,
        cpu_matmul: bool = False,
        compiler_options: dict | None = None,
        verify_tokens: int = 0,
        verify_rows: int = 0,
        draft=None,
        embeds_width: int = 0,
    ):
        self.cfg = cfg
        self.draft = draft  # a draft model every program runs after its step (model_drafts), or None
        self.embeds_width = embeds_width  # a prefill's image rows (their width; 0: a text-only model)
        # Speculative decoding's verify programs: `verify_tokens` (a row's last token and its
        # drafts) a row, for the decode batches up to `verify_rows` rows (0: none).
        self.verify_tokens = verify_tokens if "decode" in kinds else 0
        self.verify_rows = verify_rows
        self.compiler_options = dict(compiler_options or {})  # every bucket's (e.g. QUICK_COMPILE)
        self.cpu_matmul = cpu_matmul  # small products read the weights in place (see `decode`)
        self.kinds = kinds  # a disaggregated group compiles only its own role's programs
        self.layer_stack = layer_stack
        self.parallel = parallel
        # Per-row inputs are small: replicated over the mesh (or on the default device).
        self._input_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh else None
        self._devices = list(mesh.devices.flat) if mesh is not None else [jax.local_devices()[0]]
        # lazy: compile a bucket on its first use instead (one-shot CLI runs use two shapes).
        self.lazy = lazy
        self.buckets = buckets
        self.attention = attention
        self._params = jax.tree.map(_abstract, params)
        self._pages = jax.tree.map(_abstract, pages)
        self._penalties = jax.tree.map(_abstract, penalties)
        self._decode: dict[tuple[int], object] = {}  # (rows,)
        self._prefill: dict[tuple[int, int], object] = {}  # (rows, tokens)
        self._verify: dict[tuple[int, int], object] = {}  # (rows, tokens)

    @property
    def num_compiled(self) -> int:
        return len(self._decode) + len(self._prefill) + len(self._verify)

    @property
    def num_total(self) -> int:
        return len(self.shapes())

    def shapes(self) -> list[tuple]:
        """Every bucket, essential ones first, then by size (the cheaper and more common first)."""
        b = self.buckets
        rest = [("decode", n) for n in b.decode_batches if "decode" in self.kinds] + [
            ("prefill", r, t) for r, t in b.prefill_shapes if "prefill" in self.kinds
        ]
        rest += [("verify", n, t) for n, t in self.verify_shapes()]
        essential = self.essential_shapes()
        order = {"decode": 0, "verify": 1, "prefill": 2}
        rest = sorted((x for x in rest if x not in essential), key=lambda x: (order[x[0]], x[1:]))
        return essential + rest

    def essential_shapes(self) -> list[tuple]:
        """The programs compiled before serving (see the class docstring): one decode row, one
        prefill row of the fewest tokens (a short first request) and one of the most."""
        b, kinds = self.buckets, self.kinds
        tokens = b.prefill_token_buckets()
        out = [("decode", 1)] if "decode" in kinds else []
        if "prefill" in kinds:
            out += [("prefill", min(r for r, tt in b.prefill_shapes if tt == t), t) for t in (min(tokens), max(tokens))]
        return list(dict.fromkeys(out))

    def compile_all(self, workers: int = 1, progress=None, shapes=None) -> None:
        """Compiles every bucket (or `shapes`); XLA compiles outside the GIL, so threads overlap."""
        from concurrent.futures import ThreadPoolExecutor

        shapes = self.shapes() if shapes is None else shapes
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="jfire-compile") as pool:
            for i, _ in enumerate(pool.map(self._compile, shapes)):
                if progress:
                    progress(i + 1, len(shapes))

    def compile_rest(self, workers: int = 1, stop=None, before_loading=None) -> None:
        """Compiles the buckets not compiled yet (the background half of a start-up), `workers`
        at a time, until done or `stop` (a threading.Event) is set. `before_loading()` is
        called before a batch of programs that are all stored (a warm start): loading them is
        cheap, and the caller may hold it back while it is busy."""
        rest = [s for s in self.shapes() if not self._has(s)]
        for i in range(0, len(rest), max(1, workers)):
            if stop is not None and stop.is_set():
                return
            batch = rest[i : i + max(1, workers)]
            if before_loading is not None and all(self.is_stored(s) for s in batch):
                before_loading()
            self.compile_all(workers, shapes=batch)

    def verify_shapes(self) -> list[tuple[int, int]]:
        """(rows, tokens) of the verify programs: each decode batch up to `verify_rows` rows, by
        tokens a row 1 + 1, 4, 8 or 16 drafts, up to `verify_tokens` (a step verifies in the
        smallest that holds its drafts, or in a smaller one with its drafts cut, whichever pays:
        jfire.speculative.speculator). Few sizes: each is a program to compile per batch."""
        if not self.verify_tokens:
            return []
        tokens = sorted({min(self.verify_tokens, 1 + drafts) for drafts in (1, 4, 8, 16)})
        return [(n, t) for n in self.buckets.decode_batches if n <= self.verify_rows for t in tokens]

    def _table(self, kind: str) -> dict:
        tables: dict[str, dict] = {"decode": self._decode, "prefill": self._prefill, "verify": self._verify}
        return tables[kind]

    def _has(self, shape: tuple) -> bool:
        return shape[1:] in self._table(shape[0])

    def _compile(self, shape: tuple) -> None:
        exe = compile_cache.program(*self.program(shape), self._devices, self.compiler_options)
        # Tables are replaced, never mutated: the engine thread reads them while this one adds.
        if shape[0] == "decode":
            self._decode = {**self._decode, shape[1:]: exe}
        elif shape[0] == "verify":
            self._verify = {**self._verify, shape[1:]: exe}
        else:
            self._prefill = {**self._prefill, shape[1:]: exe}

    def is_stored(self, shape: tuple) -> bool:
        """Whether an earlier start stored this bucket's program (loading it is cheap)."""
        return compile_cache.is_stored(*self.program(shape), self._devices, self.compiler_options)

    def program(self, shape: tuple) -> tuple:
        """(jitted function, abstract arguments, static arguments) of a bucket: what `_compile`
        compiles, and what tests/test_cuda_export.py lowers for CUDA on a CPU-only machine."""
        i32 = jnp.int32
        s = functools.partial(jax.ShapeDtypeStruct, sharding=self._input_sharding)
        w = self.buckets.pages_per_row * len(self.cfg.cache_groups())  # each cache group's table side by side
        static = dict(
            cfg=self.cfg,
            attention=self.attention,
            layer_stack=self.layer_stack,
            parallel=self.parallel,
            cpu_matmul=self.cpu_matmul,
            draft=self.draft,
        )

        def extras(n: int, t: int, images: bool = False) -> tuple:
            """The optional inputs where the engine has any: the programs' last argument."""
            draft = DraftIn(s((n, t), i32), s((n,), i32)) if self.draft is not None else None
            embeds = (s((n, t, self.embeds_width), jnp.float32), s((n, t), jnp.bool_)) if images else None
            return (Extras(draft, embeds),) if draft is not None or embeds is not None else ()

        if shape[0] == "decode":
            _, n = shape
            return (
                decode,
                (
                    self._params,
                    self._pages,
                    s((n,), i32),
                    s((n,), i32),
                    s((n, w), i32),
                    self._rows(n),
                    self._penalties,
                    *extras(n, 1),
                ),
                static,
            )
        if shape[0] == "verify":
            _, n, t = shape
            return (
                verify,
                (
                    self._params,
                    self._pages,
                    s((n, t), i32),
                    s((n, t), i32),
                    s((n, w), i32),
                    s((n,), i32),
                    self._rows(n, t),
                    self._penalties,
                    *extras(n, t),
                ),
                static,
            )
        _, r, t = shape
        return (
            prefill,
            (
                self._params,
                self._pages,
                s((r, t), i32),
                s((r, t), i32),
                s((r, w), i32),
                s((r,), i32),
                self._rows(r),
                self._penalties,
                s((r, t), i32),
                *extras(r, t, images=self.embeds_width > 0),
            ),
            static,
        )

    def _rows(self, n: int, tokens: int | None = None) -> RowSampling:
        """Sampling rows of n rows; with `tokens`, a mask per token of each row (verify)."""
        s = functools.partial(jax.ShapeDtypeStruct, sharding=self._input_sharding)
        i32, u32, f32 = jnp.int32, jnp.uint32, jnp.float32
        words = mask_words(self.cfg.vocab_size)
        return RowSampling(
            s((n,), u32),
            s((n,), f32),
            s((n,), i32),
            s((n,), f32),
            s((n, words) if tokens is None else (n, tokens, words), i32),
            s((n,), f32),
            s((n,), f32),
            s((n,), f32),
            s((n,), i32),
            s((n,), jnp.bool_),
        )

    # -- choosing a program for a step ------------------------------------------------------------

    def decode_shape(self, rows: int) -> int:
        """The batch of the program for up to `rows` rows: the smallest compiled batch holding
        them all, else the largest compiled one (the caller runs the rest in further calls)."""
        if self.lazy:
            return self.buckets.decode_batch(rows)
        batches = sorted(n for (n,) in self._decode)
        return next((x for x in batches if x >= rows), batches[-1])

    def prefill_shape(self, longest: int, count: int) -> tuple[int, int]:
        """(rows, tokens) for up to `count` chunks, the longest `longest` tokens: the smallest
        compiled token bucket that holds the longest, the fewest rows holding them all (else
        the most: the caller runs the rest in further calls)."""
        if self.lazy:
            b = self.buckets
            t = next(x for x in b.prefill_token_buckets() if x >= longest)
            return b.prefill_rows(t, min(count, b.max_rows_for(t))), t
        t = min(tt for _, tt in self._prefill if tt >= longest)
        rows = sorted(r for r, tt in self._prefill if tt == t)
        return next((x for x in rows if x >= count), rows[-1]), t

    def verify_options(self, rows: int) -> list[tuple[int, int]]:
        """(rows, tokens) of the verify programs a step of `rows` rows may run: the fewest rows
        holding them, each number of tokens compiled so far (none: decode without drafts)."""
        shapes = self.verify_shapes() if self.lazy else sorted(self._verify)
        n = min((x for x, _ in shapes if x >= rows), default=None)
        return [(x, t) for x, t in shapes if x == n]

    def as_input(self, x: jax.Array) -> jax.Array:
        """A program's output placed as the programs take their per-row inputs (to feed it
        to the next call without a trip through the host)."""
        if self._input_sharding is None or x.sharding == self._input_sharding:
            return x
        return jax.device_put(x, self._input_sharding)

    def decode(self, rows: int):
        if self.lazy and (rows,) not in self._decode:
            self._compile(("decode", rows))
        return self._decode[(rows,)]

    def verify(self, rows: int, tokens: int):
        if self.lazy and (rows, tokens) not in self._verify:
            self._compile(("verify", rows, tokens))
        return self._verify[(rows, tokens)]

    def prefill(self, rows: int, tokens: int):
        if self.lazy and (rows, tokens) not in self._prefill:
            self._compile(("prefill", rows, tokens))
        return self._prefill[(rows, tokens)]


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
