"""Matrix products for XLA:CPU that read the weights where they lie (`cpu_matmul.cc`): float32
in and out, weights in float32 or bfloat16 (widened in registers; the same bits as float32 on
the widened weight, from half the bytes). And the build of jfire's CPU kernels (these and
`cpu_attention.cc`) into one library.

Why: the models keep each run of layers as one stacked array and scan over it. Inside the
scan XLA:CPU copies every layer's weight slice out of the stack before its dot, and at decode
sizes the copy costs more than the product (docs/performance.md). `stacked_matmuls` takes the
whole stacks and the layer index, so nothing is copied, and multiplies one input by several
stacks in one call; `matmul_nt` is the tied embedding as the output head, read row by row
instead of through a transposing dot.

The kernels are a small C++ file called through XLA's FFI, built with the machine's C++
compiler (GCC or clang) by `scripts/setup.sh` (or on first use) for the CPU it runs on. Where
no compiler or no build is to be had, `available()` is False, with one warning naming these
and the attention kernel, and the models keep XLA's dots and XLA's paged attention; the answer
is the same either way (tests/kernels/test_cpu_matmul.py, test_cpu_kernel_builds.py).

They are for small row counts (decode, short prefill chunks): above `MAX_ROWS` rows XLA's
blocked GEMM is faster than the slice copy costs, and the models use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

log = logging.getLogger("jfire.kernels")

KERNELS_DIR = Path(__file__).parent
SOURCES = tuple(KERNELS_DIR / name for name in ("cpu_matmul.cc", "cpu_attention.cc", "cpu_palette.cc"))
HEADERS = (KERNELS_DIR / "cpu_kernels.h", KERNELS_DIR / "cpu_panels.h")
BUILD_DIR = Path(__file__).with_name("_build")
COMPILERS = ("g++", "clang++", "c++")  # looked for on PATH, in this order, where $CXX names none
# With -march=native (`build`'s default) the library is built on, and keyed by, the CPU that runs
# it; another target ISA (e.g. "x86-64-v3": AVX2 and FMA, no AVX-512) lets a test run the
# branches of a smaller CPU. -ffp-contract=fast: a * b + c as one fused multiply-add everywhere
# (ISO C++ mode would contract only some), so every path rounds the same way. The FFI headers
# are -isystem: their own warnings are XLA's, not ours.
FLAGS = ("-O3", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-Wall", "-Wextra")
MATMUL_TARGETS = ("jfire_stacked_matmul", "jfire_matmul_nt")
ATTENTION_TARGETS = ("jfire_paged_attention",)  # cpu_attention.py
TARGETS = MATMUL_TARGETS + ATTENTION_TARGETS  # what a model's programs call
# cpu_palette.py's: called only by models whose weights are kept palette-coded, which refuse to
# load where the library is unavailable.
PALETTE_TARGETS = ("jfire_palette_matmul", "jfire_palette_decode", "jfire_palette_matmul_nt", "jfire_palette_rows")
UNAVAILABLE = (  # the one warning where the library cannot be had; %s: why
    "jfire: the CPU matmul kernels ("
    + ", ".join(MATMUL_TARGETS)
    + ") and the CPU decode attention kernel ("
    + ", ".join(ATTENTION_TARGETS)
    + ") are unavailable, so the models use XLA's dots and XLA's paged attention "
    "instead (the same answers, a slower decode): %s"
)
MAX_ROWS = 64  # rows (tokens) per product up to which the kernels beat a slice copy plus XLA's dot
# The head (`matmul_nt`) is a dot product per vocabulary row, for a few rows only: at 16 rows it
# took 42 ms of a decode step, and handing those rows back to XLA's blocked GEMM took the step
# from 229-237 to 201 ms. (Measured before the head's blocks of dot products, cpu_matmul.cc,
# which took 16 rows from 10.7 to 9.2 ms in isolation; not measured against XLA's since.)
HEAD_MAX_ROWS = 4
# A bfloat16 head stays on the kernel up to 32 rows: XLA would widen the whole embedding first
# (the default model's, 49152 x 576: 25-31 ms up to 16 rows against 1.5 ms at one row and 11 ms
# at 16 on the kernel; 39 against 43 ms at 64).
BF16_HEAD_MAX_ROWS = 32

# Whether the models' layer scans read their weights in place (set by the programs for a
# single-device CPU engine computing in float32). A jax user context: part of jit's cache key, local to the
# tracing thread.
_IN_PLACE = jax.make_user_context(default_value=False)
# Whose kernels a trace calls: "" for this machine's library (`available`), else the suffix of
# the target names another `library` was registered under. A jax user context too.
_LIBRARY = jax.make_user_context(default_value="")


# A speculative verify step's head: the b rows of a batch at each of t positions, [t, b, e].
# Set to b, the head takes the path a decode step of b rows takes (jfire.models.blocks.lm_head),
# so that every position's logits are the ones decode computes. A jax user context too.
_DECODE_ROWS = jax.make_user_context(default_value=0)


def decode_rows(rows: int):
    """A context manager: heads traced inside it compute [t, b, e] as t decode steps of b rows."""
    return _DECODE_ROWS(int(rows))


def decode_rows_now() -> int:
    return int(_DECODE_ROWS.value)


def in_place(enabled: bool):
    """A context manager: layer scans traced inside it use the kernels where they apply."""
    return _IN_PLACE(bool(enabled))


def in_place_enabled() -> bool:
    return bool(_IN_PLACE.value)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def find_compiler(compiler: str | None = None, search_path: str | None = None) -> str:
    """The C++ compiler to build with, as a path: `compiler` (a name on the search path, or a
    path) if given, else $CXX if set, else the first of COMPILERS on `search_path` (default
    $PATH). Raises RuntimeError saying what was looked for where there is none."""
    named = compiler or os.environ.get("CXX")
    if named:
        found = shutil.which(named, path=search_path)
        if found is None:
            raise RuntimeError(f"the C++ compiler {named!r}{'' if compiler else ' ($CXX)'} was not found")
        return found
    for name in COMPILERS:
        if found := shutil.which(name, path=search_path):
            return found
    raise RuntimeError(
        f"no C++ compiler found: none of {', '.join(COMPILERS)} is on PATH (install g++ or clang, or set CXX)"
    )


def compile_command(compiler: str, march: str, output: Path) -> list[str]:
    """The command that builds the library with `compiler` for `march` (-march=) into `output`."""
    return [compiler, f"-march={march}", *FLAGS, "-isystem", jax.ffi.include_dir(), f"-I{KERNELS_DIR}",
            *map(str, SOURCES), "-o", str(output)]  # fmt: skip


def library_path(compiler: str, march: str = "native", build_dir: Path | None = None) -> Path:
    """Where the library for these sources and flags, this compiler (a path), target ISA and CPU
    is (or would be) built."""
    code = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    made_by = repr((FLAGS, march, os.path.realpath(compiler), _cpu_flags())).encode()
    key = hashlib.sha256(code + made_by).hexdigest()[:16]
    return (build_dir or BUILD_DIR) / f"cpu_kernels-{march}-{Path(compiler).name}-{key}.so"


def build(
    compiler: str | None = None, march: str = "native", build_dir: Path | None = None, quiet: bool = False
) -> Path:
    """Compiles the kernels (a few seconds) unless already built; returns the library. With
    `compiler` (`find_compiler`'s: default $CXX, else g++, clang++ or c++ on PATH), for `march`
    ("native": this CPU), into `build_dir` (default BUILD_DIR). Raises RuntimeError with the
    compiler's message if it cannot; logs its warnings and keeps them in `diagnostics(library)`."""
    compiler = find_compiler(compiler)
    path = library_path(compiler, march, build_dir)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes building at once each finish whole.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    done = subprocess.run(compile_command(compiler, march, Path(tmp)), capture_output=True, text=True)
    if done.returncode:
        os.unlink(tmp)
        raise RuntimeError(
            f"building {', '.join(p.name for p in SOURCES)} with {compiler} failed: {done.stderr.strip()[-2000:]}"
        )
    # What the compiler said (nothing, with GCC and clang), kept beside the library: the tests
    # read it for each build they run.
    path.with_suffix(".log").write_text(done.stderr)
    os.replace(tmp, path)
    if done.stderr.strip():
        log.warning("jfire: %s warned building the CPU kernels:\n%s", compiler, done.stderr.strip()[-4000:])
    if not quiet:
        log.info("built %s", path)
    return path


def diagnostics(library: Path) -> str:
    """What the compiler printed building `library` (warnings; empty where there were none)."""
    return library.with_suffix(".log").read_text()


@functools.cache
def load(path: Path, suffix: str = "") -> None:
    """Loads the library at `path` and registers its FFI targets, each as its name + `suffix`,
    once per process. Raises OSError or AttributeError where it cannot."""
    lib = ctypes.cdll.LoadLibrary(str(path))
    for name in TARGETS + PALETTE_TARGETS:
        jax.ffi.register_ffi_target(name + suffix, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")


@functools.cache
def available() -> bool:
    """Builds (if needed), loads and registers this machine's kernels once per process; False,
    with one warning naming the matmul and the attention kernels, where they cannot be had (the
    models then keep XLA's dots and paged attention)."""
    try:
        load(build())
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning(UNAVAILABLE, e)
        return False
    return True


@functools.cache
def native_library():
    """This machine's kernels library as a ctypes handle, for its plain C functions (the
    palette encoder), or None where it cannot be had."""
    if not available():
        return None
    return ctypes.cdll.LoadLibrary(str(build(quiet=True)))


@contextlib.contextmanager
def library(path: Path):
    """Kernels traced inside it are those of the library at `path` (a `build` with another
    compiler or target ISA, as the tests run them) instead of this machine's. Its targets are
    registered under names of their own: XLA keeps one handler per name, and this process may
    hold this machine's library under the plain names already."""
    suffix = "_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    load(Path(path), suffix)
    with _LIBRARY(suffix):
        yield


def ready() -> bool:
    """Whether kernels traced here can run: another `library` chosen, or this machine's available."""
    return bool(_LIBRARY.value) or available()


def target(name: str) -> str:
    """The FFI target a trace here calls for kernel `name` (one of TARGETS)."""
    return name + _LIBRARY.value


# bfloat16 weights stay on the kernels for prefill chunks too: XLA would widen each layer's
# slice to float32 before its dot (the default model's 30 layers' products at 256 rows: 261 ms
# on the kernels against 314 ms through XLA; 75 against 181 ms at 64 rows; equal at 512).
BF16_MAX_ROWS = 512
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16)  # what the kernels read; inputs and outputs are float32


def applies(rows: int, x, *weights, max_rows: int | None = None) -> bool:
    """Whether a product of `rows` rows of x by these weights runs on the kernels (up to
    `max_rows` rows: by default MAX_ROWS, or BF16_MAX_ROWS where every weight is bfloat16)."""
    if max_rows is None:
        max_rows = BF16_MAX_ROWS if all(w.dtype == jnp.bfloat16 for w in weights) else MAX_ROWS
    return (
        in_place_enabled()
        and rows <= max_rows
        and x.dtype == jnp.float32
        and all(w.dtype in WEIGHT_DTYPES for w in weights)
        and ready()
    )


def head_max_rows(w: jax.Array) -> int:
    """Rows up to which the head (`matmul_nt`) of weight w runs on the kernel."""
    return BF16_HEAD_MAX_ROWS if w.dtype == jnp.bfloat16 else HEAD_MAX_ROWS


def stacked_matmul(x: jax.Array, stack: jax.Array, layer) -> jax.Array:
    """x [..., k] @ stack[layer] ([k, n]); stack [layers, k, n], layer an int32 scalar."""
    return stacked_matmuls(x, (stack,), layer)[0]


def stacked_matmuls(x: jax.Array, stacks, layer) -> tuple[jax.Array, ...]:
    """x [..., k] @ stack[layer] for each stack [layers, k, n_i], in one kernel call: the
    products of one input share a pass over the thread pool instead of waking it once each."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)
    shapes = tuple(jax.ShapeDtypeStruct((rows.shape[0], s.shape[2]), jnp.float32) for s in stacks)
    outs = jax.ffi.ffi_call(target("jfire_stacked_matmul"), shapes)(
        rows, jnp.asarray(layer, jnp.int32).reshape(1), *stacks
    )
    return tuple(out.reshape(*lead, s.shape[2]) for out, s in zip(outs, stacks))


def matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., k] @ w.T, w [n, k]."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)
    out = jax.ffi.ffi_call(target("jfire_matmul_nt"), jax.ShapeDtypeStruct((rows.shape[0], w.shape[0]), jnp.float32))(
        rows, w
    )
    return out.reshape(*lead, w.shape[0])


if __name__ == "__main__":  # scripts/setup.sh: build now rather than on the first engine start
    try:
        print(f"built {build(quiet=True)}")
    except RuntimeError as e:
        print(UNAVAILABLE % e)
