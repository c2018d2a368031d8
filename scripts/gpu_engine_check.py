"""The engine end to end on one device, for `scripts/gpu_check.py`: an 8B-shaped Llama in bf16
(synthetic weights with the real shapes: nothing downloads on the GPU machine) served by
`Engine` with the Pallas decode attention. Measures:
  - start-up with `--kv-cache-gb auto`: the page pool sized by the plan's arithmetic
    (`jfire.device_memory.size_pool`, as `jfire serve` sizes it, from JAX's allocator limit; the
    smoke run states 1.02 GiB), the pages the engine got, the plan's line and the device memory
    JAX reports in use after start-up; the essential programs compiled (serving), then every program;
  - the device's memory bandwidth (a reduction over 2 GiB: each byte read once, as decode
    reads the weights), and batch-1 decode tokens/s against that roofline;
  - batch-64 decode output tokens/s;
  - TTFT of a 512- and a 4,096-token prompt, and prefill's model FLOP utilisation;
  - the host's share of a decode step, and the step's wall time without and with running
    ahead (the next step dispatched before the ids are read);
  - the Pallas paged-attention decode kernel against its reference at the model's shapes.
`smoke=True` runs the same code paths with a tiny model on the CPU (the kernel in interpret
mode), so that the tests keep this file from rotting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jfire import mesh
from jfire.bench import run_wave
from jfire.checkpoint.load import LoadedModel
from jfire.device_memory import AUTO, PoolSize, size_pool
from jfire.engine import Engine, EngineConfig
from jfire.kernels.paged_attention import paged_attention, paged_attention_reference
from jfire.models.llama import LlamaConfig
from jfire.models.params import init_params
from jfire.programs import QUICK_COMPILE

LLAMA3_8B = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                        rope_theta=500000.0)
TINY_LLAMA = dataclasses.replace(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                                 num_heads=4, num_kv_heads=2, head_dim=32)
# Dense bf16 peak of the devices this may run on (tensor cores, no sparsity), for prefill's MFU.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures: the smoke run's are CPU-sized."""

    config: LlamaConfig
    dtype: str
    attention: str
    decode_tokens: int
    wide_batch: int
    prompts: tuple[int, ...]
    context: int
    prefill_budget: int
    device_memory_gib: float | None  # for --kv-cache-gb auto; None: JAX's allocator limit (a GPU)
    bandwidth_bytes: int


GPU = Sizes(LLAMA3_8B, "bfloat16", "pallas", decode_tokens=128, wide_batch=64, prompts=(512, 4096), context=4608,
            prefill_budget=1024, device_memory_gib=None, bandwidth_bytes=2 << 30)
SMOKE = Sizes(TINY_LLAMA, "float32", "pallas-interpret", decode_tokens=6, wide_batch=2, prompts=(24, 48), context=64,
              prefill_budget=32, device_memory_gib=1.02, bandwidth_bytes=16 << 20)


def jit(smoke: bool):
    """jax.jit; for the smoke run's tiny shapes with XLA's backend optimisation off, since it
    checks the code paths, not their speed (drawing the tiny model's weights: 0.5 s, not 2.9)."""
    return functools.partial(jax.jit, compiler_options=QUICK_COMPILE if smoke else None)


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second of a reduction reading `nbytes` of bf16 once (median of repeats)."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    total(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times))


def synthetic_model(sizes: Sizes) -> LoadedModel:
    """The model's every parameter drawn on the device (normal(0, 0.02), unit norms)."""
    cfg = sizes.config
    draw = jit(sizes is SMOKE)(lambda key: init_params(cfg.param_specs(), key, jnp.dtype(sizes.dtype)))
    params = draw(jax.random.key(0))
    jax.block_until_ready(params)
    return LoadedModel(config=cfg, params=params, tokenizer=None, name="llama3-8b-shaped", dtype=sizes.dtype)


def attention_kernel_check(sizes: Sizes, interpret: bool) -> dict:
    """The Pallas decode attention against the reference at the model's head layout: 16 rows,
    pages out of order, lengths up to the context."""
    cfg = sizes.config
    b, page, w = 16, 16, sizes.context // 16
    pages = b * w + 1
    dtype = jnp.dtype(sizes.dtype)
    key = jax.random.key(3)
    shape = (2, cfg.num_kv_heads, pages, page, cfg.head_dim)
    k_pages = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.float32).astype(dtype)
    q = jax.random.normal(jax.random.fold_in(key, 2), (b, cfg.num_heads, cfg.head_dim), jnp.float32).astype(dtype)
    table = jnp.asarray(np.random.default_rng(0).permutation(pages)[: b * w].reshape(b, w).astype(np.int32))
    lengths = jnp.asarray(np.random.default_rng(1).integers(1, w * page + 1, b).astype(np.int32))
    got = jit(interpret)(lambda: paged_attention(q, k_pages, v_pages, jnp.int32(1), table, lengths,
                                                 interpret=interpret))()
    want = jit(interpret)(lambda: paged_attention_reference(q[:, None], k_pages, v_pages, jnp.int32(1), table,
                                                            (lengths - 1)[:, None])[:, 0])()
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    error = float(np.abs(got - want).max())
    return {"kernel": "paged_attention", "max_abs_error": error, "agree": bool(np.allclose(got, want, rtol=2e-2, atol=2e-2))}


def prefill_flops(cfg: LlamaConfig, tokens: int) -> float:
    """Matmul FLOPs of one prompt: 2 per weight per token (the embedding lookup is no matmul,
    the output projection is), plus causal attention's QK^T and PV."""
    weights = sum(int(np.prod(s.shape)) for s in cfg.param_specs() if len(s.shape) >= 2 and s.name != "embed")
    if cfg.tie_word_embeddings:
        weights += cfg.vocab_size * cfg.hidden_size
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return 2.0 * weights * tokens + attention


def hf_config(cfg: LlamaConfig) -> dict:
    """The config.json of `cfg`: what the plan reads (no weights), so that `size_pool` plans the
    synthetic model as `jfire serve` would plan its checkpoint."""
    return {"architectures": [cfg.architecture], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
            "torch_dtype": "bfloat16"}


def memory_in_use(device) -> dict:
    """What JAX's allocator reports on `device` (GPU; CPU devices report nothing)."""
    stats = device.memory_stats() or {}
    return {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def auto_pool(sizes: Sizes, config: EngineConfig, devices) -> tuple[EngineConfig, str]:
    """`config` with its pool sized as `--kv-cache-gb auto` sizes it (device_memory.size_pool
    on a config.json of the model), and the plan's one line that serve prints at start-up."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(hf_config(sizes.config)))
        line = io.StringIO()
        with contextlib.redirect_stderr(line):
            config = size_pool(config, PoolSize(AUTO, sizes.device_memory_gib), model=d, dtype=sizes.dtype,
                               spec=mesh.resolve(None), devices=devices)
    return config, line.getvalue().strip()


def engine_check(smoke: bool, repeats: int) -> dict:
    sizes = SMOKE if smoke else GPU
    cfg = sizes.config
    device = jax.devices()[0]
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device.device_kind), None)
    result: dict = {"model": "llama3-8b-shaped" if not smoke else "tiny", "dtype": sizes.dtype,
                    "attention": sizes.attention, "device_kind": device.device_kind}
    result["kernel"] = attention_kernel_check(sizes, interpret=smoke)
    bandwidth = read_bandwidth(sizes.bandwidth_bytes, repeats)
    result["read_gbps"] = bandwidth / 1e9
    t0 = time.perf_counter()
    model = synthetic_model(sizes)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    result.update(weights_gb=weight_bytes / 1e9, weights_s=time.perf_counter() - t0)
    config = EngineConfig(max_batch=sizes.wide_batch, prefill_budget=sizes.prefill_budget,
                          max_model_len=sizes.context, attention=sizes.attention,
                          quick_compile=smoke)  # the smoke run checks paths, not speed
    gc.collect()  # the earlier checks' arrays gone before the plan reads the allocator's limit
    t0 = time.perf_counter()
    config, plan_line = auto_pool(sizes, config, jax.devices())
    result["auto_pool"] = {"plan": plan_line, "kv_cache_bytes": config.kv_cache_bytes,
                           "plan_s": time.perf_counter() - t0, "memory_before": memory_in_use(device)}
    with Engine(model, config) as engine:
        result["serving_s"] = time.perf_counter() - t0  # essential programs compiled
        engine.wait_compiled()
        result["all_compiled_s"] = time.perf_counter() - t0
        result["programs"] = engine.programs.num_compiled
        result["auto_pool"].update(pages=engine.runner.num_pages, page_size=config.page_size,
                                   memory_after=memory_in_use(device))
        run_wave(engine, 1, 16, 4, seed=0)  # every path once before timing
        waves = {}
        for batch in (1, sizes.wide_batch):
            for run_ahead in (False, True):  # side by side
                engine.config = dataclasses.replace(engine.config, run_ahead=run_ahead)
                waves[(batch, run_ahead)] = run_wave(engine, batch, 128 if not smoke else 16, sizes.decode_tokens,
                                                     seed=batch)
        result["decode"] = [{"batch": batch, "run_ahead": ahead, "output_tokens_per_s": w["output_tokens_per_s"],
                             "tpot_ms": 1e3 * w["tpot_s"]["p50"], "step_wall_ms": w["step_wall_ms"],
                             "host_share": w["host_share"], "step_ms": w["step_ms"]}
                            for (batch, ahead), w in waves.items()]
        tpot = waves[(1, True)]["tpot_s"]["p50"]
        result["batch1_tokens_per_s"] = 1.0 / tpot
        # The bytes a batch-1 decode step reads: every weight once, except the embedding, of which
        # a lookup reads one row a token (1.05 GB of the 8B model's 16 GB, untied: the LM head is a
        # separate matrix, read whole and counted). Counting the whole embedding put the roofline
        # fraction ~7% high. Tied, the embedding is the LM head and read whole. The KV read (a
        # ~200-token context: ~27 MB) is left out.
        embed = model.params["embed"]
        step_bytes = weight_bytes
        if not cfg.tie_word_embeddings:
            step_bytes -= embed.nbytes - embed.nbytes // embed.shape[0]
        result["batch1_bytes_per_token"] = step_bytes
        result["batch1_roofline_fraction"] = step_bytes / tpot / bandwidth
        result["prefill"] = []
        for n in sizes.prompts:
            run_wave(engine, 1, n, 1, seed=n + 1)  # its prefill programs run once before timing
            ttft = run_wave(engine, 1, n, 1, seed=n)["ttft_s"]["p50"]
            flops = prefill_flops(cfg, n)
            result["prefill"].append({"prompt_tokens": n, "ttft_ms": 1e3 * ttft, "tflops": flops / ttft / 1e12,
                                      "mfu": flops / ttft / (peak * 1e12) if peak else None})
    return result


def summary(r: dict) -> list[str]:
    """The engine check as a few lines of a table."""
    a = r["auto_pool"]
    mem = a["memory_after"]["bytes_in_use"]
    in_use = f"{mem / 2**30:.2f} GiB" if mem is not None else "not reported (CPU)"
    lines = [f"engine ({r['model']}, {r['dtype']}, {r['attention']} attention, {r['weights_gb']:.2f} GB of weights): "
             f"serving after {r['serving_s']:.1f} s, all {r['programs']} programs after {r['all_compiled_s']:.1f} s",
             f"  read bandwidth {r['read_gbps']:.1f} GB/s; batch-1 decode {r['batch1_tokens_per_s']:.1f} tokens/s = "
             f"{100 * r['batch1_roofline_fraction']:.1f}% of its roofline "
             f"({r['batch1_bytes_per_token'] / 1e9:.3f} GB a token: one embedding row)",
             f"  --kv-cache-gb auto: {a['pages']:,} pages of {a['page_size']} ({a['kv_cache_bytes'] / 2**30:.2f} GiB); "
             f"device memory in use after start-up {in_use}",
             f"  plan: {a['plan']}",
             f"  {'batch':>5} {'ahead':>5} {'tok/s':>9} {'TPOT':>9} {'step':>9} {'host':>6}"]
    for d in r["decode"]:
        lines.append(f"  {d['batch']:>5} {'yes' if d['run_ahead'] else 'no':>5} {d['output_tokens_per_s']:>9.1f} "
                     f"{d['tpot_ms']:>7.2f}ms {d['step_wall_ms']:>7.2f}ms {100 * d['host_share']:>5.1f}%")
    for p in r["prefill"]:
        mfu = f", MFU {100 * p['mfu']:.1f}%" if p["mfu"] is not None else ""
        lines.append(f"  TTFT {p['prompt_tokens']:>5}-token prompt {p['ttft_ms']:9.1f} ms ({p['tflops']:.2f} TFLOP/s{mfu})")
    k = r["kernel"]
    lines.append(f"  {k['kernel']} against its reference: max |error| {k['max_abs_error']:.3g}, "
                 f"agree: {'yes' if k['agree'] else 'NO'}")
    return lines
