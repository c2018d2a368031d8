"""Compiled programs kept across restarts, beside JAX's persistent compilation cache.

Two stores, both in the cache directory (`jax_compilation_cache_dir`):

`program(fn, args, static, devices)`: the engine's prefill and decode buckets, kept under a
key computed without tracing (`_program_key`: the function, its static arguments, its
arguments' shapes, dtypes and shardings, the digest of jfire's own source files, the versions,
devices, process and settings that shape a compiled program). JAX's cache is keyed by the
lowered program, so even a hit pays for tracing and lowering the model first, about 0.3 s a
program for the default model on this CPU against 0.05 s to load it: a warm start of the
default limits' 18 buckets spent most of its time tracing. Any change to jfire's code changes every key, so a
program is never loaded for code that would trace differently.

`compiled(lowered, devices)`: any lowered program, for the processes JAX's cache does not serve.

JAX's persistent compilation cache writes entries only from process 0 of a jax.distributed
cluster (`jax._src.compiler._cache_write`, sparing shared filesystems the contention). In a
jfire deployment process 0 is the frontend, which compiles nothing, and in a group spanning
processes only the leader of a colocated group is process 0 (its followers can read the
entries it writes; the processes of a deployment's groups cannot): those processes would
compile every program again on every start. For those processes jfire keeps its own entries in the same directory
(`<jax_compilation_cache_dir>/jfire-processes/`): the executable serialized with
`jax.experimental.serialize_executable`, keyed by what decides it (`_key`) and by the process
id: a restarted process (same id) finds its entries, and no process ever loads another's.
Process 0, and a process outside any cluster, leave it to JAX.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

import jfire

SUBDIR = "jfire-processes"
PROGRAMS = "jfire-programs"


# One executable serialized or loaded at a time in a process. Four times in full runs of the
# test suite a process died of a segfault inside XLA:CPU's executable serialization: once
# storing and once loading a program while other threads of the process compiled, then (with
# this lock in place) once loading a prefill program with no other thread of the process in
# Python's compile calls; a fourth and fifth time in JAX's own persistent cache, storing a
# plain jitted function's executable (`compilation_cache.put_executable_and_time`), which this
# lock did not cover then: an engine's background compiles could have been in either of JAX's
# cache calls beside the crashed one. It never happened alone, nor in stresses of engines
# starting in threads or of loads beside loads and compiles; the cause inside XLA is not known,
# so every serialization and deserialization in the process, JAX's cache's included
# (`_guard_jax_cache`), takes this lock, and the suite survives a crash anyway
# (tests/xdist_recovery.py reruns the test on a new worker). Loading takes ~50 ms a program and
# storing less, so one at a time costs start-ups nothing measurable.
_SERIALIZATION = threading.RLock()


def program(fn, args: tuple, static: dict, devices, options: dict | None = None) -> jax.stages.Compiled:
    """`fn.lower(*args, **static).compile(compiler_options=options)` (`fn` jitted, `args`
    abstract), loaded without tracing when an earlier start stored the same program (see the
    module docstring), else compiled afresh (`_compiled_afresh`: JAX's cache is not consulted)
    and stored for the next start."""
    devices = list(devices)
    path = _program_path(fn, args, static, devices, options)
    if path is None:
        return compiled(fn.lower(*args, **static), devices, options)
    return _load_or_compile(path, devices, lambda: fn.lower(*args, **static), options)


def is_stored(fn, args: tuple, static: dict, devices, options: dict | None = None) -> bool:
    """Whether `program(fn, args, static, devices, options)` would load a stored executable."""
    path = _program_path(fn, args, static, list(devices), options)
    return path is not None and path.is_file()


def _program_path(fn, args: tuple, static: dict, devices: list, options: dict | None) -> Path | None:
    """Where `program()` keeps this program; None without a cache directory."""
    root = jax.config.jax_compilation_cache_dir
    if not root:
        return None
    return Path(root) / PROGRAMS / f"{_program_key(fn, args, static, devices, options)}.pkl"


def _load_or_compile(path: Path, devices: list, lower, options: dict | None) -> jax.stages.Compiled:
    """The executable stored at `path`, else `lower()` compiled afresh and stored there."""
    loaded = _load(path, devices)
    if loaded is not None:
        return loaded
    exe = _compiled_afresh(lower(), options)
    try:
        payload = pickle.dumps(_serialize(exe))
    except Exception:  # noqa: BLE001 - an executable the backend cannot serialize is just not kept
        return exe
    _write(path, payload)
    return exe


# Compiler options at XLA's default values: they change nothing in the program, only the keys
# of JAX's executables, in memory and in its persistent cache (see `_compiled_afresh`).
_AFRESH = {"xla_embed_ir_in_executable": False, "xla_dump_hlo_as_text": False}


def _compiled_afresh(lowered: jax.stages.Lowered, options: dict | None = None) -> jax.stages.Compiled:
    """Compiled by XLA, never loaded from JAX's persistent cache: XLA:CPU serializes an
    executable it loaded from that cache without some of its kernels (the copy loaded later
    fails with "Function ... not found"), so an executable to be kept is always compiled afresh.

    JAX decides once per process whether its persistent cache is in use (turning it off around
    the process's first compilation would turn it off for every later one), so it cannot be
    turned off for one compilation; instead the store's compilations get keys of their own (the
    default-valued options above) and are never written to JAX's cache (a minimum compile time
    no compilation reaches, set for this thread only), so no read of them can hit. A program
    stored by other jfire code but lowered to the same module (a change elsewhere in the source)
    is then compiled again, not read back from an earlier start's entry."""
    from jax._src import config

    # JAX also keeps compiled executables in memory, keyed by the lowered module and the compiler
    # options: a program this process already compiled (or loaded from JAX's cache) would come
    # back as that same executable; the options make the key its own there too.
    with config.persistent_cache_min_compile_time_secs(float("inf")):
        return lowered.compile(compiler_options={**_AFRESH, **(options or {})})


def _serialize(exe: jax.stages.Compiled):
    from jax.experimental.serialize_executable import serialize

    with _SERIALIZATION:
        return serialize(exe)


def _load(path: Path, devices: list) -> jax.stages.Compiled | None:
    """The executable stored at `path`, or None (absent, truncated, or stale: recompiled and replaced)."""
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
        with _SERIALIZATION:
            return deserialize_and_load(
                serialized, in_tree, out_tree, backend=devices[0].client, execution_devices=devices
            )
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a truncated or stale entry: compile anew and replace it
        return None


def compiled(lowered: jax.stages.Lowered, devices, options: dict | None = None) -> jax.stages.Compiled:
    """`lowered.compile(compiler_options=options)`, loaded from this process's cache when an
    earlier start stored it. `devices`: the program's devices in its device-assignment order (a
    mesh's, flattened)."""
    directory = _directory()
    if directory is None:
        return lowered.compile(compiler_options=options or None)
    devices = list(devices)
    return _load_or_compile(directory / f"{_key(lowered, devices, options)}.pkl", devices, lambda: lowered, options)


def _write(path: Path, payload: bytes) -> None:
    """Written beside its final name and renamed, so a reader never sees half an entry. A cache
    that cannot be written (read-only, full) only costs the next start its compile, as with
    JAX's own cache: it never stops this one."""
    directory, tmp = path.parent, None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except OSError as e:
        print(f"jfire: not keeping a compiled program in {directory}: {e}", file=sys.stderr, flush=True)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _directory() -> Path | None:
    if jax.process_count() == 1 or jax.process_index() == 0:
        return None
    root = jax.config.jax_compilation_cache_dir
    if not root:
        return None
    return Path(root) / SUBDIR


def _key(lowered: jax.stages.Lowered, devices: list, options: dict | None = None) -> str:
    """What decides the executable and how it is called: the program's text (which names no
    argument), its argument and result trees, the compiler options, the devices (ids and model),
    the versions, the process and its cluster's size, XLA_FLAGS."""
    h = hashlib.sha256()
    for part in (
        lowered.as_text(),
        str(lowered.in_tree),
        str(lowered.out_tree),
        *_setting_parts(devices, options),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _setting_parts(devices: list, options: dict | None) -> tuple[str, ...]:
    """What both keys hold besides the program: the compiler options, the versions, the devices
    (model and ids), the process and its cluster's size, XLA_FLAGS."""
    return (
        repr(sorted((options or {}).items())),
        jfire.__version__,
        jax.__version__,
        jaxlib.__version__,
        devices[0].client.platform_version,
        devices[0].device_kind,
        repr([d.id for d in devices]),
        str(jax.process_index()),
        str(jax.process_count()),
        os.environ.get("XLA_FLAGS", ""),
    )


# jax settings that never change a compiled program (where caches and logs go, runtime guards,
# timeouts); every other setting is part of a program's key.
_NOT_IN_KEY = ("cache", "log", "transfer", "platform", "timeout", "traceback", "visible_devices", "dump")


def _program_key(fn, args: tuple, static: dict, devices: list, options: dict | None = None) -> str:
    """What decides a jitted function's executable, known before tracing it: the function and
    jfire's source (the digest of every file, since a program calls across modules), the static
    arguments, the arguments' tree, shapes, dtypes and shardings, the compiler options, the
    devices (ids and model), the versions, the process and its cluster's size, XLA_FLAGS and the
    jax settings."""
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if not any(word in k for word in _NOT_IN_KEY))
    h = hashlib.sha256()
    for part in (
        f"{fn.__module__}.{fn.__qualname__}",
        source_digest(),
        repr(sorted(static.items())),
        str(jax.tree.structure(args)),
        repr(jax.tree.leaves(args)),
        *_setting_parts(devices, options),
        repr(settings),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@functools.cache
def source_digest() -> str:
    """The digest of jfire's sources (Python, and the C++ kernels and headers programs call): a program
    stored by other code is never loaded."""
    package = Path(jfire.__file__).parent
    h = hashlib.sha256()
    for path in sorted([*package.rglob("*.py"), *package.rglob("*.cc"), *package.rglob("*.h")]):
        h.update(str(path.relative_to(package)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def default_compilation_cache_dir() -> str:
    return str(Path.home() / ".cache" / "jfire" / "xla")


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache: a second start-up loads programs instead of compiling."""
    _guard_jax_cache()
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _guard_jax_cache() -> None:
    """JAX's persistent cache serializes and deserializes executables under `_SERIALIZATION`
    too (see its comment): its two calls that do (jax._src.compiler looks them up on the module
    at each call) are wrapped once per process."""
    from jax._src import compilation_cache

    for name in ("get_executable_and_time", "put_executable_and_time"):
        call = getattr(compilation_cache, name)
        if getattr(call, "_jfire_serialized", False):
            continue

        @functools.wraps(call)
        def serialized(*args, _call=call, **kwargs):
            with _SERIALIZATION:
                return _call(*args, **kwargs)

        serialized._jfire_serialized = True  # type: ignore[attr-defined]
        setattr(compilation_cache, name, serialized)
