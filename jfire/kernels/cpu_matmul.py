"""Float32 matrix products for XLA:CPU that read the weights where they lie (`cpu_matmul.cc`),
and the build of jfire's CPU kernels (these and `cpu_attention.cc`) into one library.

Why: the models keep each run of layers as one stacked array and scan over it. Inside the
scan XLA:CPU copies every layer's weight slice out of the stack before its dot, and at decode
sizes the copy costs more than the product (docs/performance.md). `stacked_matmuls` takes the
whole stacks and the layer index, so nothing is copied, and multiplies one input by several
stacks in one call; `matmul_nt` is the tied embedding as the output head, read row by row
instead of through a transposing dot.

The kernels are a small C++ file called through XLA's FFI, built with the machine's C++
compiler by `scripts/setup.sh` (or on first use) for the CPU it runs on. Where no compiler or
no build is to be had, `available()` is False and the models keep XLA's dots; the answer is
the same either way (tests/kernels/test_cpu_matmul.py).

They are for small row counts (decode, short prefill chunks): above `MAX_ROWS` rows XLA's
blocked GEMM is faster than the slice copy costs, and the models use it.
"""

from __future__ import annotations

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
SOURCES = tuple(KERNELS_DIR / name for name in ("cpu_matmul.cc", "cpu_attention.cc"))
HEADERS = (KERNELS_DIR / "cpu_kernels.h",)
BUILD_DIR = Path(__file__).with_name("_build")
# -march=native: the library is built on (and keyed by) the CPU that runs it.
# -ffp-contract=fast: a * b + c as one fused multiply-add everywhere (ISO C++ mode would
# contract only some), so every path rounds the same way.
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-w")
TARGETS = ("jfire_stacked_matmul", "jfire_matmul_nt", "jfire_paged_attention")
MAX_ROWS = 64  # rows (tokens) per product up to which the kernels beat a slice copy plus XLA's dot
# The head (`matmul_nt`) is a dot product per vocabulary row, for a few rows only: at 16 rows it
# took 42 ms of a decode step, and handing those rows back to XLA's blocked GEMM took the step
# from 229-237 to 201 ms.
HEAD_MAX_ROWS = 4

# Whether the models' layer scans read their weights in place (set by the programs for a
# single-device float32 CPU engine). A jax user context: part of jit's cache key, local to the
# tracing thread.
_IN_PLACE = jax.make_user_context(default_value=False)


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


def library_path() -> Path:
    """Where the library for these sources, these flags and this CPU is (or would be) built."""
    code = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(code + repr(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    return BUILD_DIR / f"cpu_kernels-{key}.so"


def build(quiet: bool = False) -> Path:
    """Compiles the kernels for this machine (a few seconds) unless already built; returns the
    library. Raises RuntimeError with the compiler's message if it cannot."""
    path = library_path()
    if path.exists():
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (install g++, or set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes building at once each finish whole.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{KERNELS_DIR}", *map(str, SOURCES), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"building {', '.join(p.name for p in SOURCES)} failed: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, path)
    if not quiet:
        log.info("built %s", path)
    return path


@functools.cache
def available() -> bool:
    """Builds (if needed), loads and registers the kernels once per process; False, with one
    warning, where they cannot be had (the models then keep XLA's dots)."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        for name in TARGETS:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("jfire: the CPU matmul kernels are unavailable (%s); using XLA's dots", e)
        return False
    return True


def applies(rows: int, *arrays, max_rows: int = MAX_ROWS) -> bool:
    """Whether a product of `rows` rows over these arrays runs on the kernels."""
    return in_place_enabled() and rows <= max_rows and all(a.dtype == jnp.float32 for a in arrays) and available()


def stacked_matmul(x: jax.Array, stack: jax.Array, layer) -> jax.Array:
    """x [..., k] @ stack[layer] ([k, n]); stack [layers, k, n], layer an int32 scalar."""
    return stacked_matmuls(x, (stack,), layer)[0]


def stacked_matmuls(x: jax.Array, stacks, layer) -> tuple[jax.Array, ...]:
    """x [..., k] @ stack[layer] for each stack [layers, k, n_i], in one kernel call: the
    products of one input share a pass over the thread pool instead of waking it once each."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)
    shapes = tuple(jax.ShapeDtypeStruct((rows.shape[0], s.shape[2]), jnp.float32) for s in stacks)
    outs = jax.ffi.ffi_call("jfire_stacked_matmul", shapes)(rows, jnp.asarray(layer, jnp.int32).reshape(1), *stacks)
    return tuple(out.reshape(*lead, s.shape[2]) for out, s in zip(outs, stacks))


def matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., k] @ w.T, w [n, k]."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)
    out = jax.ffi.ffi_call("jfire_matmul_nt", jax.ShapeDtypeStruct((rows.shape[0], w.shape[0]), jnp.float32))(rows, w)
    return out.reshape(*lead, w.shape[0])


if __name__ == "__main__":  # scripts/setup.sh: build now rather than on the first engine start
    try:
        print(f"built {build(quiet=True)}")
    except RuntimeError as e:
        print(f"jfire: CPU matmul kernels not built ({e}); XLA's dots will be used")
