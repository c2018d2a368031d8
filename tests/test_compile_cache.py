"""jfire.compile_cache: a process of a jax.distributed cluster other than process 0 (whose
compilations JAX's persistent cache never stores) loads a program an earlier life of it
compiled, and the loaded program computes what the compiled one did; a different program is
never served that entry. Two lives of a real 2-process cluster, in child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from jfire.disagg.launch import free_port

REPO = Path(__file__).resolve().parents[1]

# Process 0 only hosts the cluster until process 1 is done.
HOST = """
import sys, time
from jfire.disagg import cluster
store = cluster.join(sys.argv[1], 2, 0)
store.blocking_key_value_get("done", 120_000)
"""

# Process 1 compiles (life 1) or must load (life 2: compiling raises) f, and a different g.
WORKER = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jfire import compile_cache
from jfire.disagg import cluster
from jfire.engine import enable_compilation_cache

store = cluster.join(sys.argv[1], 2, 1)
enable_compilation_cache(sys.argv[2])
must_load = sys.argv[3] == "load"

class NoCompile:
    def __init__(self, lowered):
        self.lowered = lowered
    def __getattr__(self, name):
        return getattr(self.lowered, name)
    def compile(self):
        raise RuntimeError("compiled instead of loaded")

def f(x):
    return jnp.tanh(x @ x.T) * 3 + 1

def g(x):
    return jnp.tanh(x @ x.T) * 3 + 2

x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
out = {}
lowered = jax.jit(f).lower(x)
exe = compile_cache.compiled(NoCompile(lowered) if must_load else lowered, jax.local_devices())
out["f"] = np.asarray(exe(x)).tolist()
try:
    compile_cache.compiled(NoCompile(jax.jit(g).lower(x)), jax.local_devices())
    out["g"] = "loaded"
except RuntimeError as e:
    out["g"] = str(e)
print(json.dumps(out), flush=True)
store.key_value_set("done", "1")
os._exit(0)  # leave without the shutdown handshake: the host may already be gone
"""


def life(cache: Path, mode: str) -> dict:
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    host = subprocess.Popen([sys.executable, "-c", HOST, address], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        run = subprocess.run([sys.executable, "-c", WORKER, address, str(cache), mode], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    finally:
        if host.poll() is None:
            try:
                host.wait(timeout=30)  # it leaves once the worker says it is done
            except subprocess.TimeoutExpired:
                host.kill()
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_later_life_loads_what_an_earlier_one_compiled(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    expected = np.tanh(x @ x.T) * 3 + 1
    first = life(tmp_path, "compile")
    assert len(list((tmp_path / "jfire-processes").glob("*.pkl"))) == 1  # f; g was refused before compiling
    second = life(tmp_path, "load")
    np.testing.assert_allclose(first["f"], expected, rtol=1e-6)
    assert second["f"] == first["f"]  # the loaded executable, bit for bit
    assert first["g"] == second["g"] == "compiled instead of loaded"  # another program: no entry of f's
