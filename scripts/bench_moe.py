"""MoE layer benchmark: grouped matmul (`experts_dropless`, ragged_dot) against dense
all-experts for one Mixtral-like layer at several token counts, and `experts_parallel` on
8 CPU devices with different (ep, tp) splits; then one decode step of a whole Mixtral-shaped
model on the same 8 devices at ep=1 (tp=8) and ep=4 (tp=2); medians of alternating runs.

    .venv/bin/python scripts/bench_moe.py [--hidden 1024] [--ffn 2048] [--experts 8] [--top-k 2]
                                          [--tokens 1,16,256] [--repeats 7] [--json [PATH]]

Roofline: a batch-1 step reads every weight it touches once; the dense layer touches all
3 * E * e * f weights, so on this machine (20-40 GB/s) it cannot beat bytes / bandwidth.
On XLA:CPU ragged_dot is a dense emulation (every group's weights on every row, after a
copy of the whole weight), so here `dropless` measures that emulation, not a grouped
matmul; GPU and TPU lower it to a real one. `one-by-one` (a scan over the t*k assignments,
each reading one expert) shows what reading only the chosen experts buys at batch 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402  (after the device count is set)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jfire import mesh as meshes_  # noqa: E402
from jfire import programs, sharding  # noqa: E402
from jfire.kv_cache import init_pages  # noqa: E402
from jfire.models import moe  # noqa: E402
from jfire.models.family import Parallel  # noqa: E402
from jfire.models.llama import LlamaConfig  # noqa: E402
from jfire.models.params import init_params  # noqa: E402
from jfire.sampling import init_penalty_state, neutral_rows  # noqa: E402

MESH_SPLITS = ((1, 8), (4, 2), (8, 1))  # (ep, tp); the same 8 devices, the same FLOPs per device


def time_layer(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each zero-argument callable. All are compiled and warmed
    first, then run in turn within each repeat, so drift on a shared machine hits them alike."""
    for fn in variants.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def model_step_times(mesh_texts, *, batch: int, repeats: int, hidden: int, ffn: int, experts: int, top_k: int):
    """Median seconds of one decode step of a whole Mixtral-shaped model (4 MoE layers) on
    each mesh of the same 8 devices, e.g. ep=1 (tp=8) against ep=4 (tp=2)."""
    cfg = LlamaConfig(architecture="MixtralForCausalLM", vocab_size=4096, hidden_size=hidden, intermediate_size=ffn,
                      num_layers=4, num_heads=8, num_kv_heads=8, head_dim=hidden // 8, max_position_embeddings=1024,
                      num_experts=experts, experts_per_token=top_k, moe_intermediate_size=ffn, router="softmax_topk")
    host = jax.tree.map(np.asarray, init_params(cfg.param_specs(), jax.random.key(0), jnp.float32))
    page, width = 16, 8
    tokens = np.arange(batch, dtype=np.int32) % cfg.vocab_size
    positions = np.full(batch, 100, np.int32)
    table = np.arange(batch * width, dtype=np.int32).reshape(batch, width)
    knobs = neutral_rows(batch, cfg.vocab_size)
    steps, outputs = {}, {}
    for text in mesh_texts:
        spec = meshes_.MeshSpec.inline(text)
        meshes_.check_fits(spec, cfg, jax.device_count())
        mesh = meshes_.build(spec)
        params = sharding.place(host, cfg, mesh)
        pages = init_pages(cfg, batch * width, page, jnp.float32, sharding.cache_shardings(cfg, mesh))
        state = {"pages": pages, "penalties": init_penalty_state(1, cfg.vocab_size)}

        def step(params=params, state=state):
            _, logits, state["penalties"], state["pages"] = programs.decode(
                params, state["pages"], tokens, positions, table, knobs, state["penalties"],
                                                          cfg=cfg, parallel=Parallel(mesh))
            return logits

        steps[text] = step
        outputs[text] = np.asarray(step())
    first = next(iter(outputs.values()))
    for text, out in outputs.items():  # every split computes the same step
        np.testing.assert_allclose(out, first, rtol=1e-3, atol=1e-3 * np.abs(first).max())
    return time_layer(steps, repeats)


def experts_one_by_one(x, weights, experts, w_gate, w_up, w_down):
    """A third way, for comparison only: a scan over the t*k assignments, each reading just
    its expert's weights (sensible while t*k < E, i.e. small decode batches)."""
    k = experts.shape[1]

    def one(out, a):
        expert, row = experts.reshape(-1)[a], x[a // k][None]  # [1, e]
        h = jax.nn.silu(row @ w_gate[expert]) * (row @ w_up[expert])  # [1, f]
        return out.at[a // k].add(weights.reshape(-1)[a] * (h @ w_down[expert])[0]), None

    return jax.lax.scan(one, jnp.zeros_like(x), jnp.arange(experts.size))[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model-batch", type=int, default=16, help="decode batch of the whole-model comparison")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="also write the figures as JSON (to PATH, or to stdout without one)")
    args = ap.parse_args(argv)
    e, f, num_experts, k = args.hidden, args.ffn, args.experts, args.top_k

    rng = np.random.default_rng(0)
    w = [jnp.asarray(0.02 * rng.standard_normal(s, np.float32))
         for s in [(num_experts, e, f), (num_experts, e, f), (num_experts, f, e)]]
    router_w = jnp.asarray(rng.standard_normal((e, num_experts), np.float32) / np.sqrt(e))
    weight_bytes = sum(a.nbytes for a in w)
    router = moe.Router("softmax_topk", k)
    dropless = jax.jit(lambda *a: moe.experts_dropless(*a, scale_input=False))
    dense = jax.jit(lambda *a: moe.experts_dense_reference(*a, scale_input=False))
    one_by_one = jax.jit(experts_one_by_one)

    meshes = {}
    for ep, tp in MESH_SPLITS:
        if num_experts % ep or f % tp:
            continue
        grid = np.array(jax.devices()[:8], dtype=object).reshape(1, 1, tp, ep)
        mesh = jax.sharding.Mesh(grid, ("dp", "pp", "tp", "ep"))
        specs = (P("ep", None, "tp"), P("ep", None, "tp"), P("ep", "tp", None))
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(w, specs)]
        run = jax.jit(lambda *a, mesh=mesh: moe.experts_parallel(*a, mesh=mesh, scale_input=False))
        meshes[f"ep={ep},tp={tp}"] = (mesh, placed, run)

    print(f"MoE layer: hidden {e}, expert ffn {f}, {num_experts} experts, top-{k}, float32; "
          f"expert weights {weight_bytes / 2**20:.0f} MiB; {os.cpu_count()} CPU cores; medians of {args.repeats}")
    results = []
    for t in [int(s) for s in args.tokens.split(",")]:
        x = jnp.asarray(rng.standard_normal((t, e), np.float32))
        weights, experts = jax.jit(moe.route, static_argnums=1)(x @ router_w, router)
        tokens = (x, weights, experts)
        single = {"dense": lambda: dense(*tokens, *w), "dropless": lambda: dropless(*tokens, *w)}
        if t * k <= num_experts:
            single["one-by-one"] = lambda: one_by_one(*tokens, *w)
        ref = np.asarray(dense(*tokens, *w))
        for fn in list(single.values())[1:]:
            np.testing.assert_allclose(np.asarray(fn()), ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
        row = {"tokens": t, **time_layer(single, args.repeats)}
        parallel = {}
        for name, (mesh, placed, run) in meshes.items():
            rep = [jax.device_put(a, NamedSharding(mesh, P())) for a in tokens]
            parallel[name] = lambda run=run, rep=rep, placed=placed: run(*rep, *placed)
            np.testing.assert_allclose(np.asarray(parallel[name]()), ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
        row.update(time_layer(parallel, args.repeats))
        results.append(row)

    names = ["dense", "dropless", "one-by-one", *meshes]
    print(f"{'tokens':>6} " + " ".join(f"{n + ' ms':>14}" for n in names) + f" {'dropless/dense':>15}")
    for row in results:
        cells = [f"{1e3 * row[n]:14.2f}" if n in row else f"{'-':>14}" for n in names]
        print(f"{row['tokens']:>6} " + " ".join(cells) + f" {row['dropless'] / row['dense']:15.2f}")
    one = next((r for r in results if r["tokens"] == 1), None)
    if one:
        print(f"batch 1: dense reads {weight_bytes / 1e6:.0f} MB of expert weights -> "
              f"{weight_bytes / one['dense'] / 1e9:.1f} GB/s effective")
    print("ep x tp columns: 8 host devices sharing this machine's cores (they measure the "
          "program and its psum, not 8 accelerators' speed-up)")
    model = model_step_times(["tp=8", "ep=4,tp=2"], batch=args.model_batch, repeats=args.repeats, hidden=e // 2,
                             ffn=f // 2, experts=num_experts, top_k=k)
    print(f"whole model (4 MoE layers, hidden {e // 2}, expert ffn {f // 2}), one decode step at batch "
          f"{args.model_batch} on 8 devices: " + ", ".join(f"{n} {1e3 * t:.1f} ms" for n, t in model.items())
          + f"; ep=4 / ep=1 = {model['ep=4,tp=2'] / model['tp=8']:.2f}")
    if args.json:
        doc = json.dumps({"config": {"hidden": e, "ffn": f, "experts": num_experts, "top_k": k,
                                     "dtype": "float32", "weight_bytes": weight_bytes,
                                     "repeats": args.repeats, "cpu_count": os.cpu_count()},
                          "seconds": results, "model_step_seconds": model}, indent=2)
        if args.json == "-":
            print(doc)
        else:
            with open(args.json, "w") as fh:
                fh.write(doc + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
