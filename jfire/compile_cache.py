"""Compiled programs kept across restarts for the processes JAX's persistent cache does not serve.

JAX's persistent compilation cache writes entries only from process 0 of a jax.distributed
cluster (`jax._src.compiler._cache_write`, sparing shared filesystems the contention). In a
jfire deployment process 0 is the frontend, which compiles nothing, and in a group spanning
processes only the leader is process 0: every other group process would compile every program
again on every start. For those processes jfire keeps its own entries in the same directory
(`<jax_compilation_cache_dir>/jfire-processes/`): the executable serialized with
`jax.experimental.serialize_executable`, keyed by what decides it (the lowered program's text,
the devices it runs on, the jax and jaxlib versions, the backend's platform version, XLA_FLAGS)
and by the process id: a restarted process (same id) finds its entries, and no process ever
loads another's.
Process 0, and a process outside any cluster, leave it to JAX.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from pathlib import Path

import jax
import jaxlib

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
    # Written beside its final name and renamed: a reader never sees half an entry.
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)
    return compiled


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
    h = hashlib.sha256()
    for part in (lowered.as_text(), jax.__version__, jaxlib.__version__, devices[0].client.platform_version,
                 repr([d.id for d in devices]), str(jax.process_index()), os.environ.get("XLA_FLAGS", "")):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
