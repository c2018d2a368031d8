"""`jfire bench`: offline throughput, TTFT and TPOT at several concurrencies, and start-up
time with a cold and a warm compilation cache. A program that prints figures, not a test.

Each concurrency level submits that many requests at once (random prompt ids, so no prefix
hits; EOS ignored, so every request decodes exactly --output-len tokens) and times the wave.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from jfire.engine import Engine
from jfire.sampling import SamplingParams


def percentiles(values, ps=(50, 90, 99)) -> dict:
    if not values:
        return {f"p{p}": None for p in ps}
    return {f"p{p}": float(np.percentile(values, p)) for p in ps}


def run_wave(engine: Engine, concurrency: int, prompt_len: int, output_len: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    sampling = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = [[int(x) for x in rng.integers(100, vocab, size=prompt_len)] for _ in range(concurrency)]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    counts: dict[int, int] = {}
    done = []

    def recorder(i):
        def on_output(out):
            now = time.perf_counter()
            if out.token_ids:
                first.setdefault(i, now)
                last[i] = now
                counts[i] = counts.get(i, 0) + len(out.token_ids)
            if out.finished:
                done.append(i)

        return on_output

    before = engine.stats()
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.submit(ids, sampling, on_output=recorder(i))
    while len(done) < concurrency:
        time.sleep(0.005)
    elapsed = time.perf_counter() - start
    time.sleep(0.05)  # the step that finished the last request publishes its timings just after
    after = engine.stats()
    step = {
        k: after.get(f"step_{k}_s", 0.0) - before.get(f"step_{k}_s", 0.0)
        for k in ("schedule", "prepare", "device", "outputs")
    }
    steps = after.get("steps", 0) - before.get("steps", 0)
    tokens = sum(counts.values())
    ttft = [first[i] - start for i in range(concurrency)]
    tpot = [(last[i] - first[i]) / (counts[i] - 1) for i in range(concurrency) if counts[i] > 1]
    return {
        "concurrency": concurrency,
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        # The engine thread's time per step: the host's (scheduling, building inputs, handling
        # outputs) against the device's (each program call until its ids are back).
        "steps": steps,
        "step_ms": {k: 1e3 * v / max(steps, 1) for k, v in step.items()},
        "step_wall_ms": 1e3 * elapsed / max(steps, 1),  # the wave's wall time per engine step
        "host_share": (step["schedule"] + step["prepare"] + step["outputs"]) / max(sum(step.values()), 1e-9),
    }


def measure_startup(model: str, dtype: str, cache_dir: str, engine_args: list[str]) -> dict:
    """A real `jfire serve` launched as a new process: seconds from the launch to its first
    completed request (it serves once its essential programs are compiled), and to every
    program compiled (its /health says when)."""
    import httpx

    from jfire.disagg.launch import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "jfire.cli",
        "serve",
        "--model",
        model,
        "--dtype",
        dtype,
        "--port",
        str(port),
        "--compile-cache",
        cache_dir,
        "--served-model-name",
        "bench",
        *engine_args,
    ]
    start = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first = None
        while first is None:
            if server.poll() is not None:
                raise RuntimeError(f"jfire serve exited with {server.returncode} while starting")
            try:
                r = httpx.post(
                    url + "/v1/completions", json={"model": "bench", "prompt": "Hello", "max_tokens": 8}, timeout=60
                )
                if r.status_code == 200:
                    first = time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        while httpx.get(url + "/health", timeout=60).json().get("compiling"):
            time.sleep(0.2)
        return {"first_request_s": first, "all_compiled_s": time.perf_counter() - start}
    finally:
        server.terminate()
        server.wait(timeout=180)


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'conc':>5} {'ahead':>5} {'tok/s':>9} {'x conc1':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
        f"{'TPOT p99':>9}"
    )
    lines = [head, "-" * len(head)]
    base = rows[0]["output_tokens_per_s"] if rows else 1.0
    for r in rows:
        lines.append(
            f"{r['concurrency']:>5} {'yes' if r['run_ahead'] else 'no':>5} "
            f"{r['output_tokens_per_s']:>9.1f} {r['output_tokens_per_s'] / base:>8.2f} "
            f"{r['ttft_s']['p50'] * 1e3:>7.0f}ms {r['ttft_s']['p99'] * 1e3:>7.0f}ms "
            f"{r['tpot_s']['p50'] * 1e3:>7.1f}ms {r['tpot_s']['p99'] * 1e3:>7.1f}ms"
        )
    return "\n".join(lines)


def run(args, model, engine_config, engine_args: list[str]) -> dict:
    results = {
        "model": model.name,
        "dtype": model.dtype,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "engine": {},
    }
    if not args.skip_startup:
        with tempfile.TemporaryDirectory(prefix="jfire-xla-") as cache:
            cold = measure_startup(args.model, args.dtype, cache, engine_args)
            # Three warm launches: one varies by a few tenths of a second on a shared machine.
            warms = [measure_startup(args.model, args.dtype, cache, engine_args) for _ in range(3)]
        warm = {k: statistics.median(w[k] for w in warms) for k in warms[0]}
        results["startup_s"] = {"cold": cold, "warm": warm, "warm_runs": warms}
        runs = ", ".join(f"{w['first_request_s']:.1f}" for w in warms)
        print(
            f"jfire serve, launch to first completed request: cold {cold['first_request_s']:.1f} s, warm "
            f"{warm['first_request_s']:.1f} s (median of {runs}; compilation cache reused); every program "
            f"compiled: cold {cold['all_compiled_s']:.1f} s, warm {warm['all_compiled_s']:.1f} s",
            flush=True,
        )
    t0 = time.perf_counter()
    with Engine(model, engine_config) as engine:
        results["engine"] = {
            "compiled_programs": engine.programs.num_compiled,
            "startup_s": engine.startup_s,
            "kv_pages": engine.pool.num_pages,
            "page_size": engine.config.page_size,
        }
        engine.wait_compiled()  # the waves measure serving, not background compilation
        print(f"engine ready in {time.perf_counter() - t0:.1f} s ({engine.programs.num_compiled} programs)", flush=True)
        run_wave(engine, 1, args.prompt_len, 8, seed=0)  # touch every path once before timing
        rows = []
        modes = (False, True) if args.run_ahead_ab else (engine_config.run_ahead,)
        for c in args.concurrency:
            for run_ahead in modes:  # side by side, alternating, on one engine
                engine.config = dataclasses.replace(engine.config, run_ahead=run_ahead)
                rows.append({**run_wave(engine, c, args.prompt_len, args.output_len, seed=c), "run_ahead": run_ahead})
                r = rows[-1]
                print(
                    f"  concurrency {c}{'' if run_ahead else ' (no running ahead)'}: "
                    f"{r['output_tokens_per_s']:.1f} output tokens/s; per step: "
                    + ", ".join(f"{k} {v:.2f} ms" for k, v in r["step_ms"].items())
                    + f" (host {100 * r['host_share']:.1f}%), {r['step_wall_ms']:.2f} ms a step",
                    flush=True,
                )
        spec = {k: v for k, v in engine.stats().items() if k.startswith("spec_")}
    results["waves"] = rows
    print(format_table(rows))
    if spec:  # --speculative: what the drafts did over every wave
        results["speculation"] = spec
        kept = spec["spec_accepted_tokens"] / spec["spec_draft_tokens"] if spec["spec_draft_tokens"] else 0.0
        print(
            f"speculation: {spec['spec_draft_tokens']} draft tokens verified, {kept:.0%} kept; "
            f"{spec['spec_mean_accepted_length']:.2f} tokens a verified sequence a step"
        )
    if len(rows) > 1:
        by_c = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["run_ahead"] == engine_config.run_ahead}
        if 1 in by_c and 16 in by_c:
            results["speedup_16_over_1"] = by_c[16] / by_c[1]
            print(f"throughput at concurrency 16 is {by_c[16] / by_c[1]:.2f}x concurrency 1")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.output}")
    return results
