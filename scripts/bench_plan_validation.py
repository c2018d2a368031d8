"""The plan's throughput model (jfire/throughput.py, docs/plan.md) against jfire itself, on this
CPU: predicted against measured batch-1 and batch-16 decode and the 512-token TTFT of the
default model, in one run. A program that prints figures, not a test.

    .venv/bin/python scripts/bench_plan_validation.py [--rounds 3] [--output FILE]

The model is `jfire plan`'s own (`plan.step_passes` and `throughput.model_on_mesh` for the
default model on one device, float32 weights and cache, the tied embedding read once a step as
the head). Its device is this machine instead of a spec sheet, every input measured apart from
the figures it predicts, each round, beside the engine (medians over the rounds):

  bandwidth   a reduction over a 1 GiB float32 array (bench_compare.memory_bandwidth_gbs);
              EFFICIENCY["memory"] (1.0) stands
  FLOP/s      a layer's products of the default model's shapes (random weights), chained over
              a 30-layer stack as the engine's layer scan reads it: at 256 rows through XLA's
              dot, as a prefill chunk runs them (the device's FLOP/s, so prefill efficiency 1.0),
              and at 16 rows through jfire's CPU kernel, as a 16-row decode step runs them
              (decode efficiency: that rate over the prefill one). Also, for the record, the
              same products over one layer's weights again and again (from cache: the
              arithmetic alone)
  host        the engine's own per-step timing (`stats()`: schedule + prepare + outputs over
              the steps of the wave it comes from), added to the model's step, which leaves it out

The plan model times a step's products and its attention as two phases, each under its own
max(bytes, FLOPs). Attention's efficiencies here come from micro-benchmarks at the figures'
shapes over scattered pages: jfire's decode attention kernel (bytes/s of cache read over the
bandwidth, at 1 row 576 positions deep and 16 rows 192 deep) and the reference attention
prefill chunks use (FLOP/s over the products', over the 512-token prompt's two 256-token
chunks); then step = the model's step + host.

jfire's figures, with the engine `jfire bench --compare` runs (EngineConfig(max_batch=16,
max_model_len=1024)): batch-1 decode tokens/s over 128 tokens after a 512-token prompt and that
prompt's TTFT (`bench.run_wave`, as bench_compare measures them), and batch-16 decode: 16
requests of 128-token prompts, the step rate while all 16 rows decode together (from the step
that gives the last row its first token to the one that ends the first row: no prefill in it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from jfire import mesh as meshes  # noqa: E402
from jfire import plan, throughput  # noqa: E402
from jfire.bench import run_wave  # noqa: E402
from jfire.bench_compare import memory_bandwidth_gbs  # noqa: E402
from jfire.checkpoint.load import load_config_and_tokenizer, load_model  # noqa: E402
from jfire.engine import Engine, EngineConfig  # noqa: E402
from jfire.kernels import cpu_attention, cpu_matmul  # noqa: E402
from jfire.kernels.paged_attention import paged_attention_reference  # noqa: E402
from jfire.models.params import set_path  # noqa: E402
from jfire.sampling import SamplingParams  # noqa: E402

PROMPT, DECODE = 512, 128  # batch 1 and TTFT: bench_compare's prompt and tokens
ROWS, ROWS_PROMPT, ROWS_TOKENS = 16, 128, 128  # batch 16: its concurrent wave's shape
CONTEXT = 1024  # the engine's max_model_len, as bench_compare gives it
ENGINE = EngineConfig(max_batch=ROWS, max_model_len=CONTEXT)
CHUNK = ENGINE.prefill_budget  # a prompt prefills in chunks of this many tokens
# Where the decode attention micro-benchmark puts its rows: batch 1 mid-way through its 128
# tokens after the prompt, batch 16 mid-way through theirs after 128-token prompts.
ATTENTION_AT = {1: PROMPT + DECODE // 2, ROWS: ROWS_PROMPT + ROWS_TOKENS // 2}
TOLERANCE = 0.25
INF = float("inf")


# -- the machine ---------------------------------------------------------------------------------


def layer_products(fields: dict) -> list[tuple[tuple[int, int], ...]]:
    """One layer's products as the model makes them, grouped by their input (one kernel call a
    group on the CPU kernels): (q, k, v), o, (gate, up), down, as (in, out) widths."""
    h, f = fields["hidden_size"], fields["intermediate_size"]
    q, kv = fields["num_heads"] * fields["head_dim"], fields["num_kv_heads"] * fields["head_dim"]
    return [((h, q), (h, kv), (h, kv)), ((q, h),), ((h, f), (h, f)), ((f, h),)]


@dataclasses.dataclass(frozen=True)
class Arrays:
    """The micro-benchmarks' inputs, made once: random weights of the model's layer products,
    `layers` deep, and a page pool of its cache's shape with random page tables."""

    fields: dict
    stacks: list  # per group of layer_products: a tuple of [layers, in, out] stacks
    k_pages: jax.Array  # [layers, kv_heads, pages, page_size, head_dim]
    v_pages: jax.Array

    @classmethod
    def make(cls, fields: dict) -> Arrays:
        keys = iter(jax.random.split(jax.random.key(0), 16))
        layers = fields["num_layers"]
        stacks = [
            tuple(jax.random.normal(next(keys), (layers, k, n)) / np.sqrt(k) for k, n in g)
            for g in layer_products(fields)
        ]
        # Pages enough for 16 rows of full page tables, as the engine's page tables are wide.
        pool = (
            layers,
            fields["num_kv_heads"],
            ROWS * CONTEXT // ENGINE.page_size,
            ENGINE.page_size,
            fields["head_dim"],
        )
        return cls(fields, stacks, jax.random.normal(next(keys), pool), jax.random.normal(next(keys), pool))


def best_s(run, *args, repeats: int = 5) -> float:
    jax.block_until_ready(run(*args))  # compiled, and the caches warm
    best = INF
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        best = min(best, time.perf_counter() - t)
    return best


def products_flops_per_s(a: Arrays, rows: int, kernel: bool, cached: bool = False) -> float:
    """FLOP/s of `rows` rows through a layer's products (each product's input the one before's
    output, as in the model), over every layer of the stack in turn, or over its first layer
    again and again (`cached`: the weights stay in cache, so only the arithmetic is timed);
    through XLA's dot (kernel False: what a prefill chunk, above cpu_matmul.MAX_ROWS rows, runs)
    or jfire's CPU kernel (what decode runs)."""

    def products(x, group, i):
        if kernel:
            return cpu_matmul.stacked_matmuls(x, group, i)
        return tuple(x @ w[i] for w in group)

    def layer(i, x, stacks):
        i = 0 if cached else i
        q, k, v = products(x, stacks[0], i)
        o = products(q, stacks[1], i)[0]
        gate, up = products(o, stacks[2], i)
        down = products(jax.nn.silu(gate) * up, stacks[3], i)[0]
        y = down + 1e-30 * (k.mean() + v.mean())  # k and v used, so XLA keeps their products
        return y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)  # bounded values along the chain

    layers = a.fields["num_layers"]
    run = jax.jit(lambda x, stacks: jax.lax.fori_loop(0, layers, lambda i, y: layer(i, y, stacks), x))
    seconds = best_s(run, jnp.ones((rows, a.fields["hidden_size"]), jnp.float32), a.stacks)
    return 2 * rows * layers * sum(k * n for g in layer_products(a.fields) for k, n in g) / seconds


def attention_s(a: Arrays, rows: int, tokens: int, start: int, decode: bool) -> float:
    """Seconds of attention for `rows` rows of `tokens` query tokens at positions start...,
    over every layer, each row's page table a full context wide and its pages scattered at
    random over the pool (as the engine's pool hands them out): jfire's decode kernel (decode)
    or the reference prefill chunks use."""
    f = a.fields
    rng = np.random.default_rng(start)
    width = CONTEXT // ENGINE.page_size
    table = jnp.asarray(rng.permutation(a.k_pages.shape[2])[: rows * width].reshape(rows, width), jnp.int32)
    positions = jnp.asarray(np.tile(np.arange(start, start + tokens), (rows, 1)), jnp.int32)
    q = jax.random.normal(jax.random.key(1), (rows, tokens, f["num_heads"], f["head_dim"]))
    attend = cpu_attention.paged_attention if decode else paged_attention_reference

    def layer(i, acc, k_pages, v_pages):
        return acc + attend(q + 1e-30 * acc, k_pages, v_pages, i, table, positions)

    with cpu_matmul.in_place(decode):  # the decode kernel runs where the engine's decode has it on
        run = jax.jit(lambda k, v: jax.lax.fori_loop(0, f["num_layers"], lambda i, x: layer(i, x, k, v), q * 0))
        return best_s(run, a.k_pages, a.v_pages)


def measure_machine(a: Arrays) -> dict:
    return {
        "bandwidth_bytes_per_s": memory_bandwidth_gbs() * 1e9,
        "prefill_flops_per_s": products_flops_per_s(a, CHUNK, kernel=False),
        "decode_flops_per_s": products_flops_per_s(a, ROWS, kernel=True),
        "prefill_flops_per_s_cached": products_flops_per_s(a, CHUNK, kernel=False, cached=True),
        "decode_flops_per_s_cached": products_flops_per_s(a, ROWS, kernel=True, cached=True),
        "decode_attention_s": {str(r): attention_s(a, r, 1, at, decode=True) for r, at in ATTENTION_AT.items()},
        "prefill_attention_s": sum(
            attention_s(a, 1, CHUNK, s, decode=False) for s in range(0, PROMPT, CHUNK)
        ),  # the 512-token prompt's chunks
    }


# -- jfire's own figures -------------------------------------------------------------------------


def host_s(stats_before: dict, stats_after: dict) -> tuple[float, int]:
    """(the engine thread's host time per step, steps) between two `stats()`."""
    steps = stats_after["steps"] - stats_before["steps"]
    host = sum(stats_after[f"step_{k}_s"] - stats_before[f"step_{k}_s"] for k in ("schedule", "prepare", "outputs"))
    return host / max(steps, 1), steps


def alone(engine: Engine, seed: int) -> dict:
    """One 512-token prompt, then 128 tokens: its TTFT and the mean decode step (bench_compare's
    batch-1 figures; a fresh prompt each time, so no prefix is cached)."""
    before = engine.stats()
    wave = run_wave(engine, 1, PROMPT, DECODE + 1, seed=seed)
    host, steps = host_s(before, engine.stats())  # run_wave waited for the last step's timings
    return {"ttft_s": wave["ttft_s"]["p50"], "decode_step_s": wave["tpot_s"]["p50"], "host_s": host, "steps": steps}


def together(engine: Engine, seed: int) -> dict:
    """16 requests at once; the decode step while every row decodes: from the step that gives
    the last row its first token (its prefill's; the others decode in it) to the step that
    ends the first row, steps and time from the engine's own counts as each step's outputs
    arrive. Also where the rows stand meanwhile (their mean position)."""
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(100, engine.vocab_size, size=ROWS_PROMPT)] for _ in range(ROWS)]
    sampling = SamplingParams(temperature=0.0, max_tokens=ROWS_TOKENS, ignore_eos=True)
    counts = [0] * ROWS
    marks: dict[str, tuple] = {}  # "all" and "end": (time, stats, tokens per row)
    done = []

    def recorder(i):
        def on_output(out):
            now = time.perf_counter()
            counts[i] += len(out.token_ids)
            if "all" not in marks and all(counts):
                marks["all"] = (now, engine.stats(), list(counts))
            if out.finished:
                marks.setdefault("end", (now, engine.stats(), list(counts)))
                done.append(i)

        return on_output

    for i, ids in enumerate(prompts):
        engine.submit(ids, sampling, on_output=recorder(i))
    while len(done) < ROWS:
        time.sleep(0.005)
    (t0, s0, c0), (t1, s1, c1) = marks["all"], marks["end"]
    host, steps = host_s(s0, s1)
    return {
        "decode_step_s": (t1 - t0) / steps,
        "host_s": host,
        "steps": steps,
        # a row that holds c tokens decodes at position prompt + c - 1
        "position": ROWS_PROMPT + (sum(c0) + sum(c1)) / (2 * ROWS) - 1,
    }


# -- the model's predictions ---------------------------------------------------------------------


def throughput_model(cfg) -> throughput.Model:
    """`jfire plan`'s model of `cfg` on one device, float32 weights and cache (the CPU engine's)."""
    single = SingleDeviceSharding(jax.devices()[0])
    params: dict = {}
    for spec in cfg.param_specs():
        set_path(params, spec.name, single)
    caches = {c.name: single for c in cfg.cache_specs()}
    once, tick = plan.step_passes(cfg, params, jnp.float32, pp=1)
    kv = max(plan.kv_bytes_per_token(cfg, caches, jnp.float32).values())
    return throughput.model_on_mesh(cfg, once, tick, params, caches, meshes.resolve(None), kv)


def predict(model: throughput.Model, machine: dict, host: dict, b16_position: float) -> dict:
    """Each figure on the plan's model (throughput.Model: the layers' products and attention
    each under its own max(bytes, FLOPs)) with this machine as the device and its efficiencies
    from the micro-benchmarks, host added; and its terms in seconds a step."""
    bw, flops = machine["bandwidth_bytes_per_s"], machine["prefill_flops_per_s"]
    device = throughput.Device(bw, flops, None)
    # The attention alone (no weights): its counts of KV bytes and FLOPs at unit rates.
    attention = dataclasses.replace(
        model, once=dataclasses.replace(model.once, weight_bytes=0, token_flops=0.0, row_flops=0.0)
    )
    unit = throughput.Efficiency(1.0, 1.0, 1.0)

    def count(rows: int, tokens: int, start: int, what: str) -> float:
        """The model's KV bytes ("bytes") or attention FLOPs ("flops") of a step."""
        rates = throughput.Device(1.0, INF, None) if what == "bytes" else throughput.Device(INF, 1.0, None)
        return attention.step_s(rates, rows, tokens, start, unit)

    # The efficiencies, each a micro-benchmark's rate over the device's: the products at 16 rows
    # through jfire's kernel (decode) over XLA's dot at 256 rows (the device's FLOP/s); the
    # decode attention kernel's cache reads over the bandwidth, at each figure's rows; the
    # reference attention of prefill chunks over the device's FLOP/s.
    decode_flops = machine["decode_flops_per_s"] / flops
    kv_rate = {
        str(r): count(r, 1, at, "bytes") / machine["decode_attention_s"][str(r)] for r, at in ATTENTION_AT.items()
    }
    prefill_attention = sum(count(1, CHUNK, s, "flops") for s in range(0, PROMPT, CHUNK))
    prefill_attention_rate = prefill_attention / machine["prefill_attention_s"]
    efficiency = {
        **{f"decode_{r}": throughput.Efficiency(decode_flops, 1.0, rate / bw) for r, rate in kv_rate.items()},
        "prefill": throughput.Efficiency(1.0, prefill_attention_rate / flops, 1.0),
    }
    weights = dataclasses.replace(model, kv_layer_bytes=0.0, attention_flops=0.0)

    def step(rows: int, tokens: int, starts, kind: str) -> dict:
        e = efficiency[kind]

        def mean(m: throughput.Model, d: throughput.Device) -> float:
            return float(np.mean([m.step_s(d, rows, tokens, s, e) for s in starts]))

        return {
            "plan": mean(model, device),
            "weight_bytes": mean(weights, throughput.Device(bw, INF, None)),
            "weight_flops": mean(weights, throughput.Device(INF, flops, None)),
            "attention": mean(attention, device),
        }

    def figure(terms: dict, host_s: float, value) -> dict:
        return {**terms, "host": host_s, "plan_model": value(terms["plan"] + host_s)}

    b1 = step(1, 1, range(PROMPT, PROMPT + DECODE), "decode_1")  # tpot: the mean over these positions
    b16 = step(ROWS, 1, [int(round(b16_position))], f"decode_{ROWS}")
    # The prompt alone, chunk after chunk, as throughput.figures adds up TTFT.
    chunks = [step(1, min(CHUNK, PROMPT - s), [s], "prefill") for s in range(0, PROMPT, CHUNK)]
    ttft = {k: sum(c[k] for c in chunks) for k in chunks[0]}
    return {
        "efficiency": {k: dataclasses.asdict(e) for k, e in efficiency.items()},
        "attention_rates": {"decode_kv_bytes_per_s": kv_rate, "prefill_flops_per_s": prefill_attention_rate},
        "figures": {
            "decode_b1_tps": figure(b1, host["b1"], lambda s: 1 / s),
            "decode_b16_tps": figure(b16, host["b16"], lambda s: ROWS / s),
            "ttft_512_s": figure(ttft, len(chunks) * host["b1"], lambda s: s),
        },
    }


# -- the run -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    cfg, _, _ = load_config_and_tokenizer("default")
    model = throughput_model(cfg)
    if not cpu_matmul.available():
        print("warning: jfire's CPU kernels are unavailable: decode runs on XLA's dots, not what is measured")
    arrays = Arrays.make(cfg.to_dict())
    rounds = []
    with Engine(load_model("default", "float32"), ENGINE) as engine:
        engine.wait_compiled()  # serving is measured, not background compilation
        run_wave(engine, 1, 64, 8, seed=1000)  # every path touched once before timing
        run_wave(engine, ROWS, 16, 8, seed=1001)
        for r in range(args.rounds):
            # The machine beside the engine, every round: the bandwidth here moves with the
            # neighbours on the host as much as the engine's rates do.
            m = measure_machine(arrays)
            a, t = alone(engine, seed=100 + r), together(engine, seed=200 + r)
            rounds.append({"machine": m, "alone": a, "together": t})
            print(
                f"round {r + 1}: {m['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, products "
                f"{m['prefill_flops_per_s'] / 1e9:.0f} GFLOP/s at {CHUNK} rows (XLA), "
                f"{m['decode_flops_per_s'] / 1e9:.0f} at {ROWS} rows (kernel); TTFT {a['ttft_s'] * 1e3:.0f} ms, "
                f"batch-1 step {a['decode_step_s'] * 1e3:.1f} ms, batch-16 step {t['decode_step_s'] * 1e3:.1f} ms "
                f"({t['steps']} steps)",
                flush=True,
            )

    def median(part: str, key: str) -> float:
        return statistics.median(r[part][key] for r in rounds)

    machine = {k: median("machine", k) for k in rounds[0]["machine"] if k != "decode_attention_s"}
    machine["decode_attention_s"] = {
        r: statistics.median(x["machine"]["decode_attention_s"][r] for x in rounds) for r in map(str, ATTENTION_AT)
    }
    host = {"b1": median("alone", "host_s"), "b16": median("together", "host_s")}
    predicted = predict(model, machine, host, median("together", "position"))
    results = {
        "model": "default",
        "dtype": "float32",
        "machine": machine,
        "host_s_per_step": host,
        "efficiency": predicted["efficiency"],
        "attention_rates": predicted["attention_rates"],
        "weight_bytes_per_step": model.once.weight_bytes,
        "kv_bytes_per_token": model.kv_layer_bytes * len(model.once.layers),
        "predicted": predicted["figures"],
        "measured": {
            "decode_b1_tps": 1 / median("alone", "decode_step_s"),
            "decode_b16_tps": ROWS / median("together", "decode_step_s"),
            "ttft_512_s": median("alone", "ttft_s"),
        },
        "rounds": rounds,
    }
    print(format_table(results))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.output}")
    return 0


def format_table(results: dict) -> str:
    m, e, a = results["machine"], results["efficiency"], results["attention_rates"]
    g = 1e9
    lines = [
        f"machine: {m['bandwidth_bytes_per_s'] / g:.1f} GB/s; layer products {m['prefill_flops_per_s'] / g:.0f} "
        f"GFLOP/s at {CHUNK} rows (XLA's dot; {m['prefill_flops_per_s_cached'] / g:.0f} from cache), "
        f"{m['decode_flops_per_s'] / g:.0f} at {ROWS} rows (jfire's kernel; {m['decode_flops_per_s_cached'] / g:.0f} "
        f"from cache)",
        "attention: decode kernel reads the cache at "
        + ", ".join(f"{v / g:.1f} GB/s ({r} row{'s' * (r != '1')})" for r, v in a["decode_kv_bytes_per_s"].items())
        + f"; prefill reference {a['prefill_flops_per_s'] / g:.0f} GFLOP/s of the model's count",
        "efficiency (products' FLOPs, attention FLOPs, attention memory): "
        + "; ".join(
            f"{k} {v['flops']:.2f}, {v['attention_flops']:.2f}, {v['attention_memory']:.2f}" for k, v in e.items()
        ),
        f"host: {results['host_s_per_step']['b1'] * 1e3:.2f} ms a step alone, "
        f"{results['host_s_per_step']['b16'] * 1e3:.2f} ms at {ROWS} rows; weights read a step "
        f"{results['weight_bytes_per_step'] / 1e6:.0f} MB, KV {results['kv_bytes_per_token'] / 1e3:.1f} kB a token",
        "",
        f"{'figure':<23}{'predicted':>10}{'measured':>10}{'ratio':>7}  {'within 25%':<11}"
        "ms a step: weights bytes / FLOPs, attention, host",
    ]
    for key, label in (
        ("decode_b1_tps", "batch-1 decode tok/s"),
        ("decode_b16_tps", "batch-16 decode tok/s"),
        ("ttft_512_s", "TTFT 512 tokens, s"),
    ):
        p, measured = results["predicted"][key], results["measured"][key]
        ok = "yes" if abs(p["plan_model"] / measured - 1) <= TOLERANCE else "NO"
        terms = f"{p['weight_bytes'] * 1e3:.1f} / {p['weight_flops'] * 1e3:.1f}, {p['attention'] * 1e3:.1f}, "
        lines.append(
            f"{label:<23}{p['plan_model']:>10.3g}{measured:>10.3g}{measured / p['plan_model']:>7.2f}  {ok:<11}"
            f"{terms}{p['host'] * 1e3:.1f}"
        )
    lines.append(
        "predicted: the plan's model (products and attention each under its own max(bytes, FLOPs)) on this "
        "machine's measured rates; ratio: measured / predicted; within 25%: |predicted / measured - 1| <= 0.25; "
        f"medians of {len(results['rounds'])} rounds"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
