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

from jfire.deployment_secret import DeploymentSecret, to_env
from jfire.disagg.launch import free_port

REPO = Path(__file__).resolve().parents[1]

# Process 0 only hosts the cluster until process 1 is done.
HOST = """
import sys, time
from jfire import deployment_secret
from jfire.disagg import cluster
store = cluster.join(sys.argv[1], 2, 0, secret=deployment_secret.from_env())
store.blocking_key_value_get("done", 120_000)
"""

# Process 1 compiles (life 1) or must load (life 2: compiling raises) f, and a different g.
WORKER = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jfire import compile_cache, deployment_secret
from jfire.disagg import cluster
from jfire.engine import enable_compilation_cache

store = cluster.join(sys.argv[1], 2, 1, secret=deployment_secret.from_env())
enable_compilation_cache(sys.argv[2])
must_load = sys.argv[3] == "load"

class NoCompile:
    def __init__(self, lowered):
        self.lowered = lowered
    def __getattr__(self, name):
        return getattr(self.lowered, name)
    def compile(self, **options):
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
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **to_env(DeploymentSecret.generate())}  # the cluster's store signs
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


# --- the program store: programs kept under a key known before tracing ----------------------

# One life of a process using jfire.compile_cache.program: compiles (and stores) or, with
# "load", must load every program (compiling afresh raises). Prints the outputs and which
# programs it could not load.
PROGRAM_LIFE = """
import functools, json, sys
import jax, jax.numpy as jnp, numpy as np
from jfire import compile_cache
from jfire.engine import enable_compilation_cache

enable_compilation_cache(sys.argv[1])
if len(sys.argv) > 3:  # another version of jfire's code, which lowers h to the same module
    compile_cache.source_digest = lambda: sys.argv[3]
    jax.jit(lambda a: a + 1)(jnp.zeros(2))  # as in an engine, JAX's cache is in use by then
if sys.argv[2] == "load":
    def refuse(lowered, options=None):
        raise RuntimeError("compiled instead of loaded")
    compile_cache._compiled_afresh = refuse

@functools.partial(jax.jit, static_argnames=("scale",), donate_argnames=("acc",))
def f(x, acc, *, scale):
    return acc + jnp.tanh(x @ x.T) * scale

x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
out = {}
for name, args, static in [("f", (x, jnp.zeros((3, 3))), {"scale": 3.0}),
                           ("other static", (x, jnp.zeros((3, 3))), {"scale": 2.0}),
                           ("other shape", (x[:2], jnp.zeros((2, 2))), {"scale": 3.0})]:
    abstract = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in args)
    try:
        exe = compile_cache.program(f, abstract, static, jax.local_devices())
        out[name] = np.asarray(exe(*args)).tolist()
    except RuntimeError as e:
        out[name] = str(e)
    if sys.argv[2] == "compile":
        break  # life 1 stores f alone
print(json.dumps(out), flush=True)
"""


def program_life(cache: Path, mode: str) -> dict:
    run = subprocess.run([sys.executable, "-c", PROGRAM_LIFE, str(cache), mode], cwd=REPO,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_stored_program_loads_without_compiling_and_computes_the_same(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    first = program_life(tmp_path, "compile")
    np.testing.assert_allclose(first["f"], np.tanh(x @ x.T) * 3, rtol=1e-6)
    assert len(list((tmp_path / "jfire-programs").glob("*.pkl"))) == 1
    second = program_life(tmp_path, "load")
    assert second["f"] == first["f"]  # the stored executable, bit for bit
    # Another static argument or argument shape is another program: never served f's entry.
    assert second["other static"] == second["other shape"] == "compiled instead of loaded"


# A program this process first ran through plain jit (JAX's persistent cache on), then stored.
JIT_THEN_STORE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jfire import compile_cache
from jfire.engine import enable_compilation_cache

enable_compilation_cache(sys.argv[1])

@jax.jit
def h(x):
    return jnp.tanh(x @ x.T) + jnp.arange(x.shape[0], dtype=x.dtype)

x = jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
out = {}
if sys.argv[2] in ("jit", "jit then store"):
    out["jit"] = np.asarray(h(x)).tolist()
if sys.argv[2] == "jit then store":  # the store's compilation is its own, not jit's executable
    out["own executable"] = (compile_cache._compiled_afresh(h.lower(x)).runtime_executable()
                             is not h.lower(x).compile().runtime_executable())
if sys.argv[2] in ("jit then store", "load"):
    exe = compile_cache.program(h, (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),), {},
                                jax.local_devices())
    out["program"] = np.asarray(exe(x)).tolist()
print(json.dumps(out), flush=True)
"""


def test_a_program_first_run_through_jit_is_stored_whole(tmp_path):
    """JAX keeps compiled executables in memory by lowered module: a program a process already
    ran through plain jit, whose executable came from JAX's persistent cache, would be stored
    as that executable, which XLA:CPU serializes without some of its kernels (a later start's
    copy then failed with "Function iota... not found"). The store compiles its own, and the
    stored program computes what jit did in a third process."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    want = np.tanh(x @ x.T) + np.arange(3)

    def run(mode):
        done = subprocess.run([sys.executable, "-c", JIT_THEN_STORE, str(tmp_path), mode], cwd=REPO,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    np.testing.assert_allclose(run("jit")["jit"], want, rtol=1e-6)  # fills JAX's persistent cache
    second = run("jit then store")  # jit loads from JAX's cache; the program store then stores
    assert second["own executable"] and second["program"] == second["jit"]
    assert run("load")["program"] == second["jit"]


def test_a_program_stored_by_other_code_is_compiled_again_not_read_from_jaxs_cache(tmp_path):
    """After an upgrade of jfire's code every stored program's key changes, but a program the
    change did not touch lowers to the same module: its compilation must not be an executable
    an earlier start left in JAX's persistent cache (stored again, it would miss kernels), and
    what the new code stores computes what the old code's did."""
    def run(mode, digest):
        done = subprocess.run([sys.executable, "-c", JIT_THEN_STORE, str(tmp_path), mode, digest], cwd=REPO,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    old = run("load", "old code")  # compiles and stores under the old code's key
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("jit_h")], "the store wrote to JAX's cache"
    new = run("load", "new code")  # compiles again for the new code's key
    assert run("load", "new code")["program"] == new["program"] == old["program"]


def test_jaxs_own_cache_serializes_and_deserializes_under_the_serialization_lock(monkeypatch):
    """XLA:CPU's executable serialization has crashed processes with several threads in it
    (compile_cache's comment on `_SERIALIZATION`): JAX's persistent cache (which the suite's
    processes use, conftest) serializes a new jitted function's executable, and reads it back,
    holding the same lock as the program store."""
    import jax
    import jax.numpy as jnp
    from jax._src import compilation_cache as jax_cache

    from jfire import compile_cache

    held = []
    for name in ("combine_executable_and_time", "extract_executable_and_time"):  # beside each (de)serialization
        inner = getattr(jax_cache, name)

        def spy(*args, _inner=inner, _name=name):
            held.append((_name, compile_cache._SERIALIZATION._is_owned()))
            return _inner(*args)

        monkeypatch.setattr(jax_cache, name, spy)
    salt = float(os.getpid() % 1000) + 0.25  # a function no earlier process stored
    f = jax.jit(lambda x: jnp.sin(x) * salt)
    want = np.asarray(f(jnp.arange(4.0)))
    jax.clear_caches()  # the next call reads JAX's persistent cache
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: jnp.sin(x) * salt)(jnp.arange(4.0))), want)
    assert ("combine_executable_and_time", True) in held, held
    assert ("extract_executable_and_time", True) in held, held
    assert all(owned for _, owned in held), held


def test_a_program_key_covers_the_source_arguments_options_and_devices(monkeypatch):
    import jax
    import jax.numpy as jnp

    from jfire import compile_cache

    f = jax.jit(lambda x, *, scale: x * scale, static_argnames=("scale",))
    devices = jax.local_devices()
    args = (jax.ShapeDtypeStruct((4,), jnp.float32),)
    key = compile_cache._program_key(f, args, {"scale": 2.0}, devices)
    assert key == compile_cache._program_key(f, args, {"scale": 2.0}, devices)  # stable
    assert key != compile_cache._program_key(f, args, {"scale": 3.0}, devices)
    assert key != compile_cache._program_key(f, (jax.ShapeDtypeStruct((4,), jnp.int32),), {"scale": 2.0}, devices)
    assert key != compile_cache._program_key(f, (jax.ShapeDtypeStruct((5,), jnp.float32),), {"scale": 2.0}, devices)
    quick = {"xla_backend_optimization_level": 0}  # a quick-compiled program is kept apart
    assert key != compile_cache._program_key(f, args, {"scale": 2.0}, devices, quick)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=/nowhere")
    assert key != compile_cache._program_key(f, args, {"scale": 2.0}, devices)
    monkeypatch.undo()
    monkeypatch.setattr(compile_cache, "source_digest", lambda: "other source")
    assert key != compile_cache._program_key(f, args, {"scale": 2.0}, devices)  # jfire's code changed


# An engine's second start loads every bucket it compiled in its first (none is traced or
# compiled: compiling afresh raises), and generates exactly what the first did.
ENGINE_LIFE = """
import json, sys
from jfire import compile_cache
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.sampling import SamplingParams

if sys.argv[3] == "load":
    def refuse(lowered, options=None):
        raise RuntimeError("compiled instead of loaded")
    compile_cache._compiled_afresh = refuse
model = load_model(sys.argv[1])
engine = Engine(model, EngineConfig(max_batch=2, num_pages=64, prefill_budget=32, max_model_len=128,
                                    compilation_cache_dir=sys.argv[2])).start()
assert engine.wait_compiled(300)
done = engine.generate([([1, 5, 9, 2], SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)),
                        ([3] * 20, SamplingParams(max_tokens=4, temperature=0.8, seed=7))])
print(json.dumps({"programs": engine.programs.num_compiled, "total": engine.programs.num_total,
                  "ids": [c.token_ids for c in done]}), flush=True)
engine.shutdown()
"""


def test_an_engine_started_again_loads_every_program_and_generates_the_same(tmp_path, tiny_hf_dir):
    model = tiny_hf_dir("llama2")

    def engine_life(mode):
        run = subprocess.run([sys.executable, "-c", ENGINE_LIFE, str(model), str(tmp_path / "cache"), mode],
                             cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    first = engine_life("compile")
    assert first["programs"] == first["total"] > 3
    second = engine_life("load")
    assert second == first


def test_quick_compiles_pass_their_options_to_xla_and_give_the_full_compiles_tokens(tiny_hf_dir, monkeypatch):
    """EngineConfig.quick_compile (`--quick-compile`): every bucket is compiled with
    programs.QUICK_COMPILE, and the engine's tokens and logprobs are those of full compiles."""
    import jax

    from jfire import compile_cache
    from jfire.checkpoint.load import load_model
    from jfire.engine import Engine, EngineConfig
    from jfire.programs import QUICK_COMPILE
    from jfire.sampling import SamplingParams

    seen = []
    afresh = compile_cache._compiled_afresh

    def spy(lowered, options=None):
        seen.append(options)
        return afresh(lowered, options)

    monkeypatch.setattr(compile_cache, "_compiled_afresh", spy)
    # A function of its own (never stored by another test): compiling it must pass the options.
    f = jax.jit(lambda x: x * 7.0 + 1.0)
    exe = compile_cache.program(f, (jax.ShapeDtypeStruct((3,), np.float32),), {}, jax.local_devices(), QUICK_COMPILE)
    assert seen == [QUICK_COMPILE] and exe(np.ones(3, np.float32)).tolist() == [8.0] * 3

    model = load_model(str(tiny_hf_dir("qwen3")), "float32")
    requests = [([1, 5, 9, 2], SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)),
                ([3] * 20, SamplingParams(max_tokens=6, temperature=0.8, seed=7, logprobs=2))]
    outs = {}
    for quick in (False, True):
        config = EngineConfig(max_batch=2, num_pages=64, prefill_budget=32, max_model_len=128, aot=False,
                              quick_compile=quick)
        with Engine(model, config) as engine:
            assert engine.programs.compiler_options == (QUICK_COMPILE if quick else {})
            handles = [engine.submit(ids, sampling) for ids, sampling in requests]
            outs[quick] = [([i for o in outputs for i in o.token_ids], [lp for o in outputs for lp in o.logprobs or []])
                           for outputs in (list(h) for h in handles)]
    for (ids_full, lp_full), (ids_quick, lp_quick) in zip(outs[False], outs[True]):
        assert ids_quick == ids_full and len(lp_full) == len(ids_full)
        np.testing.assert_allclose([t[0] for t in lp_quick], [t[0] for t in lp_full], rtol=0, atol=1e-5)
