"""The CPU matmul kernels (jfire/kernels/cpu_matmul.cc) at the row counts of decode and
speculative verify steps: the default model's (SmolLM2-135M, float32) 30 layers' products and
its tied head, at 1, 2, 5, 9, 16 and 36 rows, ms per call and the ratio to 1 row. A program
that prints figures, not a test.

    .venv/bin/python scripts/bench_verify_rows.py [--reps 15] [--rows 1,2,5,9,16,36] [--bf16]
        [--old REV [--old-source FILE]] [--only layers,head] [--cpu-time] [--compiler g++]

`--old REV` (e.g. HEAD) also builds the kernels as they were at git revision REV (or with
FILE as their cpu_matmul.cc) into a temporary directory and times both, alternating call by
call, and says where their outputs differ (they should not: the same sums in the same order).
The machine may be shared: medians (and minimums) of --reps calls each; `taskset -c 0 ...
--cpu-time` gives one core's CPU time, steadier when others run. The layers' products are one jitted scan over the 30 layers
(q/k/v in one call, o, gate/up in one call, down), as the models call them.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jfire.kernels import cpu_matmul  # noqa: E402

LAYERS, E, KV, F, VOCAB = 30, 576, 192, 1536, 49152


def build_old(rev: str, compiler: str | None, matmul_source: str | None = None) -> Path:
    """The kernels' library built from git revision `rev`'s sources (its cpu_matmul.cc replaced
    by the file `matmul_source` if given), into a temporary dir."""
    tmp = Path(tempfile.mkdtemp(prefix="jfire-old-kernels-"))
    for path in (*cpu_matmul.SOURCES, *cpu_matmul.HEADERS):
        rel = path.relative_to(REPO)
        text = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=REPO, capture_output=True, text=True, check=True)
        (tmp / path.name).write_text(text.stdout)
    if matmul_source:
        (tmp / "cpu_matmul.cc").write_text(Path(matmul_source).read_text())
    out = tmp / "old.so"
    cmd = [cpu_matmul.find_compiler(compiler), "-march=native", *cpu_matmul.FLAGS, "-isystem", jax.ffi.include_dir(),
           f"-I{tmp}", *(str(tmp / p.name) for p in cpu_matmul.SOURCES), "-o", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return out


def layer_stack_fn():
    def run(x, qw, kw, vw, ow, gw, uw, dw):
        def layer(h, j):
            q, k, v = cpu_matmul.stacked_matmuls(h, (qw, kw, vw), j)
            (o,) = cpu_matmul.stacked_matmuls(q + 1e-3 * jnp.tile(k + v, (1, E // KV)), (ow,), j)
            h = h + 1e-3 * o
            g, u = cpu_matmul.stacked_matmuls(h, (gw, uw), j)
            (d,) = cpu_matmul.stacked_matmuls(jnp.tanh(g) * u, (dw,), j)
            return jnp.tanh(h + 1e-3 * d), None

        return jax.lax.scan(layer, x, jnp.arange(LAYERS, dtype=jnp.int32))[0]

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,2,5,9,16,36")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 weights (default float32)")
    ap.add_argument("--old", default=None, help="git revision whose kernels to time alongside")
    ap.add_argument("--old-source", default=None, help="with --old: a cpu_matmul.cc to build as the old one")
    ap.add_argument("--compiler", default=None)
    ap.add_argument("--only", default="layers,head")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the process's CPU seconds, not wall time: steadier on a shared machine "
        "when run on one core (taskset -c 0), where no thread waits spinning for another",
    )
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    dtype = jnp.bfloat16 if args.bf16 else jnp.float32

    libs = {"new": cpu_matmul.build(compiler=args.compiler)}
    if args.old:
        libs = {"old": build_old(args.old, args.compiler, args.old_source), **libs}
    rng = np.random.default_rng(0)

    def weight(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-2]), dtype)

    def weights():
        stacks = (weight(LAYERS, E, E), weight(LAYERS, E, KV), weight(LAYERS, E, KV), weight(LAYERS, E, E),
                  weight(LAYERS, E, F), weight(LAYERS, E, F), weight(LAYERS, F, E))  # fmt: skip
        return stacks, weight(VOCAB, E)

    # Each library multiplies its own copy of the weights (the same values): on a shared one,
    # the second library's call would find in cache what the first had just read.
    seed_state = rng.bit_generator.state
    copies = {}
    for name in libs:
        rng.bit_generator.state = seed_state
        copies[name] = weights()
    parts = args.only.split(",")

    # One compiled function per (library, part, rows), traced under that library's targets.
    fns = {}
    xs = {m: jnp.asarray(rng.standard_normal((m, E), dtype=np.float32)) for m in rows_list}
    for name, path in libs.items():
        stacks, head = copies[name]
        with cpu_matmul.library(path):
            for m in rows_list:
                x = xs[m]
                if "layers" in parts:
                    a = (x, *stacks)
                    fns[name, "layers", m] = (jax.jit(layer_stack_fn()).lower(*a).compile(), a)
                if "head" in parts:
                    a = (x, head)
                    fns[name, "head", m] = (jax.jit(cpu_matmul.matmul_nt).lower(*a).compile(), a)
    for f, a in fns.values():  # compile and warm
        jax.block_until_ready(f(*a))

    times = {key: [] for key in fns}
    clock = time.process_time if args.cpu_time else time.perf_counter
    names = list(libs)
    for rep in range(args.reps):
        for m in rows_list:
            for part in parts:
                # Each library takes each place in the order in turn: a call right after another
                # part's ran slower than one after the same part's (the head at 1 row, bfloat16:
                # 6.1 ms against 3.2, the same kernel).
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    f, a = fns[name, part, m]
                    t0 = clock()
                    jax.block_until_ready(f(*a))
                    times[name, part, m].append(clock() - t0)

    if args.old:  # the same rows, bit for bit
        for part in parts:
            for m in rows_list:
                fo, ao = fns["old", part, m]
                fn, an = fns["new", part, m]
                same = np.array_equal(np.asarray(fo(*ao)), np.asarray(fn(*an)))
                if not same:
                    print(f"!! {part} at {m} rows: old and new differ")

    what = "CPU" if args.cpu_time else "wall"
    print(f"weights {jnp.dtype(dtype).name}, {args.reps} reps, median {what} ms (ratio to {rows_list[0]} rows)")
    for part in parts:
        print(f"{part}:")
        for m in rows_list:
            line = f"  {m:3d} rows"
            for name in libs:
                med = statistics.median(times[name, part, m]) * 1e3
                base = statistics.median(times[name, part, rows_list[0]]) * 1e3
                lo = min(times[name, part, m]) * 1e3
                line += f"   {name} {med:7.2f} ms (min {lo:6.2f}, x{med / base:4.2f})"
            print(line)


if __name__ == "__main__":
    main()
