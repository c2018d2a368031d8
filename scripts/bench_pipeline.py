"""Pipeline micro-batching benchmark: pp=4 (x tp=2) on 8 CPU devices, the same decode and
prefill steps with 4 micro-batches and with 1, timed side by side (medians of several runs).

    .venv/bin/python scripts/bench_pipeline.py [--layers 16] [--hidden 512] [--batch 16]

Without micro-batches a pipeline runs one stage at a time (the other three wait); with them,
after a 3-tick fill all four stages work on every tick.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402  (after the device count is set)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jfire import mesh as meshes  # noqa: E402
from jfire import programs, sharding  # noqa: E402
from jfire.kv_cache import init_pages  # noqa: E402
from jfire.models.llama import LlamaConfig  # noqa: E402
from jfire.models.params import init_params  # noqa: E402
from jfire.sampling import init_penalty_state, neutral_rows  # noqa: E402
from jfire.pipeline import Pipeline  # noqa: E402


def time_calls(fn, repeats: int) -> float:
    fn()  # compile and warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefill-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)

    cfg = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=4096, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 3, num_layers=args.layers, num_heads=8, num_kv_heads=8,
                      head_dim=args.hidden // 8, max_position_embeddings=1024)
    host = jax.tree.map(np.asarray, init_params(cfg.param_specs(), jax.random.key(0), jnp.float32))
    b, page = args.batch, 16
    width = 8
    table = np.arange(b * width, dtype=np.int32).reshape(b, width)
    knobs = neutral_rows(b, cfg.vocab_size)
    results = {}
    for micro in (1, 4):
        spec = meshes.MeshSpec(name=f"pp=4,tp=2,microbatches={micro}", pp=4, tp=2, microbatches=micro)
        mesh = meshes.build(spec)
        params = sharding.place(host, cfg, mesh)
        pages = init_pages(cfg, b * width, page, jnp.float32, sharding.cache_shardings(cfg, mesh))
        stack = Pipeline(mesh, micro)
        state = {"pages": pages, "penalties": init_penalty_state(1, cfg.vocab_size)}
        tokens = np.ones(b, np.int32)
        positions = np.full(b, 40, np.int32)

        def decode_step():
            out, _, state["penalties"], state["pages"] = programs.decode(
                params, state["pages"], tokens, positions, table, knobs, state["penalties"], cfg=cfg, layer_stack=stack)
            out.ids.block_until_ready()

        t = args.prefill_tokens
        p_tokens = np.ones((b, t), np.int32)
        p_positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))

        def prefill_step():
            out, _, state["penalties"], state["pages"] = programs.prefill(
                params, state["pages"], p_tokens, p_positions, table, np.full(b, t - 1, np.int32), knobs,
                state["penalties"], np.full((b, t), -1, np.int32), cfg=cfg, layer_stack=stack)
            out.ids.block_until_ready()

        results[micro] = {"decode_step_s": time_calls(decode_step, args.repeats),
                          "prefill_step_s": time_calls(prefill_step, args.repeats)}
        print(f"pp=4 tp=2, {micro} micro-batch(es): decode step {results[micro]['decode_step_s'] * 1e3:.1f} ms "
              f"(batch {b}), prefill step {results[micro]['prefill_step_s'] * 1e3:.1f} ms ({b}x{t} tokens)",
              flush=True)
    for kind in ("decode_step_s", "prefill_step_s"):
        print(f"{kind[:-7]}: 4 micro-batches are {results[1][kind] / results[4][kind]:.2f}x faster than 1")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
