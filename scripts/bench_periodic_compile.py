"""Compile time of a Llama 4 whose MoE and dense layers alternate (MoE every second layer, NoPE
every fourth), at ep=2 x tp=2 on 4 CPU devices: the prefill and decode programs traced, lowered
and compiled by XLA, as the engine builds them ahead of time.

    .venv/bin/python scripts/bench_periodic_compile.py [--layers 4 8 16] [--rounds 3]
    .venv/bin/python scripts/bench_periodic_compile.py --baseline /tmp/jfire-old

With `--baseline DIR` (another jfire checkout, e.g. `git worktree add /tmp/jfire-old REV`)
each round measures this checkout and DIR's in fresh processes one after the other, so a
busy machine slows both alike, and the medians are printed side by side with their ratio.
jfire scans one period (dense, moe) of such a model per `lax.scan` step; before that every
layer was its own one-layer segment, compiled unrolled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def measure(layers: list[int], repeats: int) -> dict:
    """{layers: {"prefill": [(wall s, cpu s)...], "decode": [...], "segments": n}} in this process.
    CPU seconds (this process, all threads) are the steadier figure on a shared machine."""
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        + ["--xla_force_host_platform_device_count=4"]
    )
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jfire import mesh as meshes
    from jfire import programs, sharding
    from jfire.kv_cache import init_pages
    from jfire.models.family import Parallel
    from jfire.models.llama4 import Llama4Config
    from jfire.models.params import init_params
    from jfire.sampling import init_penalty_state, neutral_rows

    jax.config.update("jax_enable_compilation_cache", False)
    spec = meshes.MeshSpec.inline("ep=2,tp=2")
    mesh = meshes.build(spec)
    jax.jit(lambda x: x + 1).lower(np.ones(4)).compile()  # the backend's one-time start, outside the figures
    out: dict = {}
    for n in layers:
        times: dict = {"prefill": [], "decode": []}
        for r in range(repeats):
            # A context length of its own each repeat: a new static config, so nothing is reused
            # from the previous compile of the same program.
            cfg = Llama4Config(
                architecture="Llama4ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=48,
                intermediate_size_mlp=96, num_layers=n, num_heads=8, num_kv_heads=4, head_dim=8,
                max_position_embeddings=1024 + r, num_experts=8, experts_per_token=1,
                moe_layers=tuple(range(1, n, 2)), rope_layers=tuple(i for i in range(n) if (i + 1) % 4),
                attention_chunk_size=8,
            )
            host = jax.tree.map(np.asarray, init_params(cfg.param_specs(), jax.random.key(0), jnp.float32))
            wide, params, _ = sharding.adapt_to_mesh(cfg, sharding.place(host, cfg, mesh), mesh)
            b, t, width, page = 4, 16, 8, 4
            pages = init_pages(wide, b * width, page, jnp.float32, sharding.cache_shardings(wide, mesh))
            table = np.arange(b * width, dtype=np.int32).reshape(b, width)
            # One table per cache group, side by side (a checkout from before cache groups has one).
            table = np.tile(table, (1, len(wide.cache_groups()) if hasattr(wide, "cache_groups") else 1))
            rows, penalties = neutral_rows(b, cfg.vocab_size), init_penalty_state(1, cfg.vocab_size)
            common = dict(cfg=wide, parallel=Parallel(mesh))
            start = time.perf_counter(), time.process_time()
            programs.prefill.lower(
                params, pages, np.ones((b, t), np.int32), np.tile(np.arange(t, dtype=np.int32), (b, 1)), table,
                np.full(b, t - 1, np.int32), rows, penalties, np.full((b, t), -1, np.int32), **common,
            ).compile()
            times["prefill"].append((time.perf_counter() - start[0], time.process_time() - start[1]))
            start = time.perf_counter(), time.process_time()
            programs.decode.lower(
                params, pages, np.ones(b, np.int32), np.full(b, 20, np.int32), table, rows, penalties, **common
            ).compile()
            times["decode"].append((time.perf_counter() - start[0], time.process_time() - start[1]))
        out[n] = {**times, "segments": len(cfg.segments())}
    return out


def run_in(checkout: Path, layers: list[int], repeats: int) -> dict:
    """`measure` in a fresh process importing jfire from `checkout`."""
    env = {**os.environ, "PYTHONPATH": f"{checkout}{os.pathsep}{HERE / 'scripts'}"}
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import jfire; "
        "assert jfire.__file__.startswith(sys.argv[1]), jfire.__file__; "
        "from bench_periodic_compile import measure; "
        "print(json.dumps(measure(json.loads(sys.argv[2]), int(sys.argv[3]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(checkout), json.dumps(layers), str(repeats)],
        env=env,
        capture_output=True, text=True, check=True, cwd="/",
    )
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per checkout")
    ap.add_argument("--repeats", type=int, default=2, help="compiles of each program per process")
    ap.add_argument("--baseline", type=Path, default=None, help="another jfire checkout to compare with")
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    checkouts = {"this": HERE} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    samples: dict = {name: {n: {"prefill": [], "decode": []} for n in args.layers} for name in checkouts}
    segments: dict = {}
    for _ in range(args.rounds):
        for name, checkout in checkouts.items():
            for n, got in run_in(checkout, args.layers, args.repeats).items():
                for program in ("prefill", "decode"):
                    samples[name][n][program] += got[program]
                segments[(name, n)] = got["segments"]
    # CPU seconds (all threads of the process) barely move when other work shares the machine;
    # wall seconds do, so the least disturbed compile (the minimum) is shown beside the median.
    figures = {
        name: {
            n: {
                p: {
                    "cpu_s": statistics.median(c for _, c in v),
                    "wall_s": statistics.median(w for w, _ in v),
                    "wall_min_s": min(w for w, _ in v),
                }
                for p, v in progs.items()
            }
            for n, progs in per.items()
        }
        for name, per in samples.items()
    }
    print(
        "Llama 4, MoE every 2nd layer, NoPE every 4th, ep=2 x tp=2 (4 CPU devices): seconds to trace, lower and "
        f"compile each program, {args.rounds * args.repeats} compiles each: median CPU (all threads), median wall, "
        "minimum wall"
    )
    for n in args.layers:
        for program in ("prefill", "decode"):
            this = figures["this"][n][program]
            line = (
                f"  {n:3d} layers {program:7s} this ({segments[('this', n)]} segment(s)): "
                f"{this['cpu_s']:5.2f} {this['wall_s']:5.2f} {this['wall_min_s']:5.2f}"
            )
            if args.baseline:
                base = figures["baseline"][n][program]
                ratios = " ".join(f"{this[k] / base[k]:.2f}" for k in ("cpu_s", "wall_s", "wall_min_s"))
                line += (
                    f"   baseline ({segments[('baseline', n)]} segment(s)): "
                    f"{base['cpu_s']:5.2f} {base['wall_s']:5.2f} {base['wall_min_s']:5.2f}   this/baseline {ratios}"
                )
            print(line, flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"config": {k: str(v) for k, v in vars(args).items()}, "samples": samples,
                       "figures": figures}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
