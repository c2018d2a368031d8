"""Compiled programs kept across restarts for the processes JAX's persistent cache does not serve.

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

import hashlib
import os
import pickle
import sys
import tempfile
from pathlib import Path

import jax
import jaxlib

import jfire

SUBDIR = "jfire-processes"


def compiled(lowered: jax.stages.Lowered, devices) -> jax.stages.Compiled:
    """`lowered.compile()`, loaded from this process's cache when an earlier start stored it.
    `devices`: the program's devices in its device-assignment order (a mesh's, flattened)."""
    directory = _directory()
    if directory is None:
        return lowered.compile()
    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    devices = list(devices)
    path = directory / f"{_key(lowered, devices)}.pkl"
    if path.exists():
        try:
            serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
            return deserialize_and_load(serialized, in_tree, out_tree, backend=devices[0].client,
                                        execution_devices=devices)
        except Exception:  # noqa: BLE001 - a truncated or stale entry: compile anew and replace it
            pass
    compiled = lowered.compile()
    try:
        payload = pickle.dumps(serialize(compiled))
    except Exception:  # noqa: BLE001 - an executable the backend cannot serialize is just not kept
        return compiled
    _write(directory, path, payload)
    return compiled


def _write(directory: Path, path: Path, payload: bytes) -> None:
    """Written beside its final name and renamed, so a reader never sees half an entry. A cache
    that cannot be written (read-only, full) only costs the next start its compile, as with
    JAX's own cache: it never stops this one."""
    tmp = None
    try:
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
    directory = Path(root) / SUBDIR
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _key(lowered: jax.stages.Lowered, devices: list) -> str:
    """What decides the executable and how it is called: the program's text (which names no
    argument), its argument and result trees, the devices (ids and model), the versions, the
    process and its cluster's size, XLA_FLAGS."""
    h = hashlib.sha256()
    for part in (lowered.as_text(), str(lowered.in_tree), str(lowered.out_tree), jfire.__version__,
                 jax.__version__, jaxlib.__version__, devices[0].client.platform_version, devices[0].device_kind,
                 repr([d.id for d in devices]), str(jax.process_index()), str(jax.process_count()),
                 os.environ.get("XLA_FLAGS", "")):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
