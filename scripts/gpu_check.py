"""The prepared GPU run: the engine end to end on an 8B-shaped Llama (start-up, decode and
prefill speed against the device's roofline, the host's share of a step), every Pallas kernel
against its reference, the bf16 decode kernel's GB/s against a device copy, and the MoE grouped
matmul (ragged_dot) against dense all-experts for a Llama 4 Scout layer.

    python scripts/gpu_check.py [--output gpu_check.json]   # one call on one GPU (H200: a few minutes)
    python scripts/gpu_check.py --smoke                    # CPU-sized, interpret mode (run by the tests)

Nothing can be downloaded on the GPU machine, so the weights are synthetic with real shapes
and checkpoint layouts: all of SmolLM2-135M (the default model) and two layers of
Llama-3-8B, drawn on the device (normal, the scale of trained weights), with NaN payloads,
infinities, subnormals and signed zeros planted in every tensor. Then:
  1. every tensor decoded by the reference and by the Pallas kernel, compared bit for bit;
  2. layers of stacked tensors decoded one at a time (the keep-compressed mode);
  3. decode GB/s (bf16 out) of both decoders, and of a copy kernel, per tensor and in total;
  4. a sweep of the kernel's tile size and warps on the largest tensor;
  4b. the fused palette matmul (the weight read coded, rebuilt in bf16 tile by tile before
     its dot) against XLA's dot on the plain bf16 weight, Llama-3-8B's MLP shapes, batch 1
     and 64;
  4c. compressed-resident decode on a Llama-3-8B-shaped layer stack: tokens/s plain, kept
     coded and decoded per layer, and multiplied coded where the start-up measurement picks
     the fused matmul, batch 1 and 64;
  5. one Scout-shaped MoE layer (hidden 5120, 16 experts of width 8192, top-1, bf16): the
     dropless layer with the Pallas grouped matmul (jfire.kernels.grouped_matmul), with XLA's
     `jax.lax.ragged_dot` (a padded dense matmul on CUDA) and every expert computed, at 1, 16,
     256 and 2,048 tokens, results compared; the kernel's tiles swept on the gate matmul;
  6. Kimi K2.5's MLA decode and int4 expert kernels against their references, then one whole
     Kimi K2.5-shaped MoE layer (MLA at its heads and latent sizes, 384 int4 routed experts,
     the config in tests/data/kimi-k2.5) decoding at batch 1 and 8 over a 4k context: the
     Pallas MLA and int4 kernels against the XLA reference path;
  6b. the Pallas prefill attention kernel against the reference at 4k and 16k tokens
     (Llama-3-8B's attention shapes, one chunk from position 0), and the MLA prefill kernel
     at Kimi K2.5's shapes (a 2k-token chunk);
  7. the engine: an 8B-shaped Llama in bf16 served by `Engine` with the Pallas attention
     (`scripts/gpu_engine_check.py`: start-up, batch-1 decode against the read-bandwidth
     roofline, batch-64 decode, TTFT of 512 and 4,096-token prompts and prefill MFU, each
     decode without and with running ahead, the paged-attention kernel against its reference),
     started with `--kv-cache-gb auto` (the pool from the plan's arithmetic, JAX's allocator set
     as `jfire serve` sets it); the roofline counts one embedding row a token, not the table.
Prints a summary and writes all figures as JSON; exits 1 if anything is not bit-exact.

Time on one H100 (80 GB, 3.35 TB/s, 989 dense bf16 TF/s), estimated from the sizes (never
yet run on a GPU; compiles guessed at 1-5 s a program, the engine's at its CPU count):
  1-4 compression: 1.1 GB of bf16 encoded on the host (~20 s), decodes at GB/s (~5 s),
      20 tile configs compiled and timed (~30 s)                                      ~ 1 min
  4b  palette matmul: 235 MB of bf16 encoded on the host (~3 s), 4 compiles, 8 timings  ~ 0.25 min
  4c  coded layers: 0.9 GB of bf16 encoded on the host (~10 s), the start-up measurement
      (4 layouts x 4 row counts), 6 compiles, 6 timings                               ~ 0.5 min
  5   Scout MoE: 4 GB of experts; 4 token counts x 3 paths compiled (~40 s; the largest
      call, dense at 2,048 tokens, 8 TFLOP: ~15 ms), 12 tile variants (~30 s), the scan
      over 8 GB (~10 s)                                                               ~ 1.5 min
  6   Kimi kernels (~15 s); the Kimi layer: 9.5 GB of weights drawn (~1 s), 4 compiles
      (~30 s), the XLA reference unpacking 8.5 GB of int4 into 34 GB of bf16 (~15 ms a
      call, 11 calls a batch)                                                         ~ 0.75 min
  6b  prefill attention at 4k and 16k (the 16k reference materialises 34 GB of scores,
      ~0.1 s a call) and MLA prefill at 2k                                            ~ 0.75 min
  7   engine: 16 GB drawn (~5 s), start-up with every program compiled (~1-2 min),
      8 decode waves of up to 64 x 128 tokens (~15 s), 4 TTFTs (~5 s)                  ~ 2.5 min
  in all about 7.25 minutes, under the 8 the prepared call has (--repeats 10 throughout;
  `--repeats 3` takes ~20 s off); an H200 is a little faster.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # jfire, bench_compression

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_compression import measure, median_seconds  # noqa: E402  (beside this script)
from gpu_engine_check import engine_check, jit, summary  # noqa: E402  (beside this script)
from jfire.checkpoint import codec  # noqa: E402
from jfire.checkpoint.compressed import layout_for  # noqa: E402
from jfire.kernels.bf16_decode import bf16_decode, pad_payload  # noqa: E402
from jfire.models import moe  # noqa: E402
from jfire.models.llama import LlamaConfig  # noqa: E402

SMOLLM2_135M = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                           tie_word_embeddings=True)
LLAMA3_8B_2_LAYERS = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                                 intermediate_size=14336, num_layers=2, num_heads=32, num_kv_heads=8, head_dim=128,
                                 max_position_embeddings=8192)
TINY = dataclasses.replace(SMOLLM2_135M, vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=32)
# bf16 patterns every tensor must survive: NaNs with payloads, infinities, subnormals, signed zeros, extremes.
SPECIALS = np.array([0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x0000, 0x8000, 0x7F7F, 0xFF7F],
                    np.uint16)


def synthetic(config: LlamaConfig, prefix: str, seed: int, only=None):
    """(name, bf16 bits, checkpoint layout) for the compressible parameters of `config` (those
    named in `only`, if given)."""
    out = []
    for i, spec in enumerate(config.param_specs()):
        if (only and spec.name not in only) or np.prod(spec.shape) < codec.MIN_VALUES:
            continue
        key = jax.random.fold_in(jax.random.key(seed), i)
        scale = 0.1 if spec.init == "ones" else 0.02
        values = jax.random.normal(key, spec.shape, jnp.float32) * scale + (1.0 if spec.init == "ones" else 0.0)
        bits = np.array(jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16))
        flat = bits.reshape(-1)
        flat[np.random.default_rng(seed + i).choice(flat.size, 64, replace=False)] = np.resize(SPECIALS, 64)
        out.append((f"{prefix}.{spec.name}", bits, layout_for(spec)))
    return out


def check_units(tensors, encoded: dict, decoder_kwargs) -> list[dict]:
    """First and last layer of each stacked tensor decoded alone, against the original layer."""
    rows = []
    decode_unit = jax.jit(lambda c, u: bf16_decode(c, u, **decoder_kwargs))
    for name, bits, layout in tensors:
        if not layout.unit_axes:
            continue
        c = jax.device_put(encoded[name])
        for unit in (0, layout.units - 1):
            got = np.asarray(jax.lax.bitcast_convert_type(decode_unit(c, unit), jnp.uint16))
            rows.append({"name": name, "unit": unit, "exact": bool(np.array_equal(got, bits[unit]))})
    return rows


def sweep(name, bits, c, configs, interpret: bool, repeats: int) -> list[dict]:
    """Decode GB/s of the kernel at each (block_lanes, num_warps), on one tensor."""
    c = jax.device_put(c)
    c = pad_payload(c, 1 << (c.payload.shape[0] - 1).bit_length())
    rows = []
    for block_lanes, num_warps in configs:
        run = jax.jit(lambda c, b=block_lanes, w=num_warps: bf16_decode(c, interpret=interpret, block_lanes=b,
                                                                      num_warps=w))
        exact = bool(np.array_equal(np.asarray(jax.lax.bitcast_convert_type(run(c), jnp.uint16)), bits))
        seconds = median_seconds(lambda: run(c).block_until_ready(), repeats)
        rows.append({"name": name, "block_lanes": block_lanes, "num_warps": num_warps, "exact": exact,
                     "gbps": bits.nbytes / seconds / 1e9})
    return rows


def palette_matmul_check(smoke: bool, repeats: int) -> list[dict]:
    """The fused palette matmul (jfire.kernels.palette_matmul: the weight read in its
    palette-coded form, each 64 x 64 tile rebuilt in bf16 just before its dot) against XLA's
    dot on the plain bf16 weight, at Llama-3-8B's MLP shapes (gate 4096 x 14336, down 14336 x
    4096), batch 1 and 64, bf16 inputs, float32 out: ms of each, bytes read over the time
    (coded for the kernel, bf16 for XLA), and agreement with the plain product (to bf16
    rounding: the two sum in different orders). In the smoke run (interpret mode) the kernel
    must equal its reference bit for bit."""
    from jfire.checkpoint import palette
    from jfire.kernels.palette_matmul import palette_matmul, palette_matmul_reference

    shapes = [(128, 256), (256, 128)] if smoke else [(4096, 14336), (14336, 4096)]
    rows = []
    for i, shape in enumerate(shapes):
        key = jax.random.fold_in(jax.random.key(29), i)
        w = (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)
        p = jax.device_put(palette.encode(np.asarray(w), palette.make_layout(shape)))
        coded_bytes = sum(a.nbytes for a in jax.tree.leaves(p))
        plain = jit(smoke)(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
        fused = jit(smoke)(lambda x, p: palette_matmul(x, p, interpret=smoke, out_dtype=jnp.float32))
        for m in (1, 16) if smoke else (1, 64):
            x = jax.random.normal(jax.random.fold_in(key, 100 + m), (m, shape[0]), jnp.float32).astype(jnp.bfloat16)
            got, want = np.asarray(fused(x, p)), np.asarray(plain(x, w))
            scale = float(np.abs(want).max())
            agree = bool(np.allclose(got, want, rtol=1e-2, atol=1e-2 * scale))
            if smoke:
                agree = agree and bool(np.array_equal(got, np.asarray(palette_matmul_reference(x, p, out_dtype=jnp.float32))))
            t_fused = median_seconds(lambda: fused(x, p).block_until_ready(), repeats)  # noqa: B023 (called here)
            t_plain = median_seconds(lambda: plain(x, w).block_until_ready(), repeats)  # noqa: B023
            rows.append({"shape": list(shape), "batch": m, "k": p.layout.k, "ratio": coded_bytes / w.nbytes,
                         "fused_ms": 1e3 * t_fused, "bf16_dot_ms": 1e3 * t_plain, "fused_over_bf16": t_fused / t_plain,
                         "fused_read_gbps": coded_bytes / t_fused / 1e9, "bf16_read_gbps": w.nbytes / t_plain / 1e9,
                         "agree": agree})
    return rows


def coded_layers_check(smoke: bool, repeats: int) -> list[dict]:
    """Compressed-resident decode on a Llama-3-8B-shaped layer stack (its 2 layers, a 4,096-token
    vocabulary so the head does not hide them), bf16, one decode step at a 512-token context:
    tokens/s with the layers plain, kept palette-coded and decoded per layer in the loop
    (`--keep-compressed`), and kept coded with the linear layers multiplied coded where the
    start-up measurement (`fused_rows`) found the fused matmul faster, at batch 1 and 64. Logits
    against the plain layers' (to bf16 rounding: sums in other orders). Smoke: the tiny shapes,
    the fused matmul forced up to 64 rows (interpret mode is never faster)."""
    from jfire.checkpoint import palette
    from jfire.checkpoint.compressed import compressed_bytes, fuse_layers, palette_layout_for, serves_fused
    from jfire.models import family
    from jfire.models.params import get_path, set_path

    cfg = dataclasses.replace(TINY if smoke else LLAMA3_8B_2_LAYERS, vocab_size=512 if smoke else 4096)
    plain: dict = {}
    kept: dict = {}
    for i, spec in enumerate(cfg.param_specs()):
        key = jax.random.fold_in(jax.random.key(31), i)
        scale = 0.1 if spec.init == "ones" else 0.02
        value = (jax.random.normal(key, spec.shape, jnp.float32) * scale + (spec.init == "ones")).astype(jnp.bfloat16)
        set_path(plain, spec.name, value)
        coded = spec.per_layer and serves_fused(spec)
        layout = palette_layout_for(spec)
        set_path(kept, spec.name, jax.device_put(palette.encode(np.asarray(value), layout)) if coded else value)
    fused = fuse_layers(kept, cfg, jnp.bfloat16, max_rows=64 if smoke else None)
    chosen = {s.name: getattr(get_path(fused, s.name), "max_rows", 0) for s in cfg.param_specs()
              if s.per_layer and serves_fused(s)}  # fmt: skip
    context = 64 if smoke else 512
    rows = []
    for batch in (1, 16) if smoke else (1, 64):
        tokens = jnp.ones((batch, 1), jnp.int32)
        positions = jnp.full((batch, 1), context, jnp.int32)
        step = jit(smoke)(lambda p, c: family.forward(p, cfg, tokens, positions, c), donate_argnums=1)  # noqa: B023
        row: dict = {"batch": batch, "fused_max_rows": chosen}
        logits = {}
        for name, params in (("plain", plain), ("kept", kept), ("fused", fused)):
            cache = family.init_cache(cfg, batch, context + 1, jnp.bfloat16)
            out, cache = step(params, cache)
            logits[name] = np.asarray(out, np.float32)
            box = [cache]

            def one(params=params, box=box, step=step):
                out, box[0] = step(params, box[0])
                out.block_until_ready()

            seconds = median_seconds(one, repeats)
            row[f"{name}_tokens_per_s"] = batch / seconds
            row[f"{name}_layer_bytes"] = compressed_bytes(params["layers"])
        scale = float(np.abs(logits["plain"]).max())
        row["agree"] = all(bool(np.allclose(logits[n], logits["plain"], rtol=0, atol=2e-2 * scale))
                           for n in ("kept", "fused"))  # fmt: skip
        rows.append(row)
    return rows


def moe_check(smoke: bool, repeats: int) -> list[dict]:
    """One Scout-shaped MoE layer at 1, 16, 256 (and on a GPU 2,048) tokens, three ways: the dropless
    layer with the Pallas grouped matmul (jfire.kernels.grouped_matmul, a GPU's default), the same
    layer with XLA's ragged_dot (`use_impl("xla")`; on CUDA a zero-padded dense dot over every
    expert), and every expert computed densely. All must agree (bf16 inputs, float32 accumulation,
    so to bf16 rounding). `kernel_weight_gbps`: the bytes of the experts that have tokens over the
    kernel's time (the decode roofline's numerator)."""
    from jfire.kernels.int4_experts import use_impl

    hidden, ffn, experts, top_k = (64, 128, 4, 1) if smoke else (5120, 8192, 16, 1)
    kernel_impl = "pallas-interpret" if smoke else "pallas"
    key = jax.random.key(7)
    w = [(0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)).astype(jnp.bfloat16)
         for i, shape in enumerate([(experts, hidden, ffn), (experts, hidden, ffn), (experts, ffn, hidden)])]
    grouped = jit(smoke)(lambda *a: moe.experts_dropless(*a, scale_input=True))
    dense = jit(smoke)(lambda *a: moe.experts_dense_reference(*a, scale_input=True))

    def under(impl, *args):  # the impl is a jax user context: part of jit's cache key
        def call():
            with use_impl(impl):
                return grouped(*args).block_until_ready()
        return call

    rows = []
    for tokens in (1, 16, 256) if smoke else (1, 16, 256, 2048):
        x = jax.random.normal(jax.random.fold_in(key, 100 + tokens), (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
        logits = jax.random.normal(jax.random.fold_in(key, 200 + tokens), (tokens, experts), jnp.float32)
        weights, chosen = moe.route(logits, moe.Router("sigmoid_input", top_k))
        args = (x, weights, chosen, *w)
        kernel, xla = under(kernel_impl, *args), under("xla", *args)
        a, b = np.asarray(kernel(), np.float32), np.asarray(xla(), np.float32)
        c = np.asarray(dense(*args), np.float32)
        scale = float(np.abs(c).max())
        close = all(bool(np.allclose(v, c, rtol=2e-2, atol=2e-2 * scale)) for v in (a, b))
        t_kernel, t_xla = median_seconds(kernel, repeats), median_seconds(xla, repeats)
        t_dense = median_seconds(lambda: dense(*args).block_until_ready(), repeats)  # noqa: B023 (called here)
        touched = np.unique(np.asarray(chosen)).size * 3 * hidden * ffn * 2  # bf16 bytes of the experts used
        rows.append({"tokens": tokens, "kernel": "grouped_matmul", "kernel_ms": 1e3 * t_kernel, "xla_ragged_dot_ms": 1e3 * t_xla,
                     "dense_ms": 1e3 * t_dense, "kernel_over_xla": t_kernel / t_xla,
                     "kernel_over_dense": t_kernel / t_dense, "kernel_weight_gbps": touched / t_kernel / 1e9,
                     "agree": close})
    return rows


def moe_scan_check(smoke: bool, repeats: int) -> dict:
    """Two Scout-shaped MoE layers stacked [2, ...] and run by `lax.scan`, as the models run their
    layers, at one token with the Pallas grouped matmul: whether XLA copies a layer's whole experts
    out of the stack before the kernel (a custom call takes a buffer, not a slice of one), seen as
    a compiled temporary of at least one layer's experts, and the time per layer. A copy would
    cost more than the bytes the kernel reads at decode (all 16 experts against one)."""
    from jfire.kernels.int4_experts import use_impl

    hidden, ffn, experts = (64, 128, 4) if smoke else (5120, 8192, 16)
    key = jax.random.key(23)
    shapes = [(2, experts, hidden, ffn), (2, experts, hidden, ffn), (2, experts, ffn, hidden)]
    w = [(0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)).astype(jnp.bfloat16)
         for i, shape in enumerate(shapes)]
    x = jax.random.normal(jax.random.fold_in(key, 9), (1, hidden), jnp.float32).astype(jnp.bfloat16)
    weights, chosen = moe.route(jax.random.normal(key, (1, experts), jnp.float32), moe.Router("sigmoid_input", 1))

    def layers(x, weights, chosen, *stack):
        def one(h, p):
            return moe.experts_dropless(h, weights, chosen, *p, scale_input=True), None
        return jax.lax.scan(one, x, stack)[0]

    run = jit(smoke)(layers)
    with use_impl("pallas-interpret" if smoke else "pallas"):
        temp = int(run.lower(x, weights, chosen, *w).compile().memory_analysis().temp_size_in_bytes)

        def call():
            return run(x, weights, chosen, *w).block_until_ready()

        seconds = median_seconds(call, repeats)
    layer_bytes = 3 * experts * hidden * ffn * 2
    return {"layers": 2, "ms_per_layer": 1e3 * seconds / 2, "temp_bytes": temp, "layer_expert_bytes": layer_bytes,
            "layer_copied": temp >= layer_bytes}


def moe_tiles_check(smoke: bool, repeats: int) -> list[dict]:
    """The grouped matmul's tiles (`grouped_matmul.Tiles`) swept on Scout's gate matmul ([16
    experts, 5120, 8192], bf16) at decode (8 rows over 8 experts) and prefill (2,048 rows)
    sizes: `choose_tiles`' pick first, then alternatives, for tuning it on the device."""
    from jfire.kernels import grouped_matmul as gm

    hidden, ffn, experts = (64, 128, 4) if smoke else (5120, 8192, 16)
    key = jax.random.key(17)
    w = (0.02 * jax.random.normal(key, (experts, hidden, ffn), jnp.float32)).astype(jnp.bfloat16)
    rows = []
    for a in (8, 256) if smoke else (8, 2048):
        used = min(a, experts // 2)
        sizes = jnp.asarray(np.bincount(np.arange(a) % used, minlength=experts).astype(np.int32))
        xs = jax.random.normal(jax.random.fold_in(key, a), (a, hidden), jnp.float32).astype(jnp.bfloat16)
        want = np.asarray(gm.grouped_matmul_reference(xs, w, sizes))
        chosen = gm.choose_tiles(a, experts, hidden, ffn)
        if smoke:
            variants = [dataclasses.replace(chosen, k_splits=2)]
        elif chosen.rows < 64:
            variants = [gm.Tiles(16, n, k, splits, 4, stages) for n, k, splits, stages in
                        [(32, 128, 1, 4), (64, 128, 1, 4), (128, 64, 1, 3), (32, 128, 2, 4), (64, 64, 4, 4), (16, 128, 1, 4)]]
        else:
            variants = [gm.Tiles(r, n, k, 1, warps, 3) for r, n, k, warps in
                        [(64, 128, 64, 4), (128, 128, 64, 8), (128, 128, 32, 4), (64, 64, 64, 4)]]
        for tiles in [chosen] + [t for t in variants if t != chosen]:
            run = jit(smoke)(lambda xs, w, sizes, t=tiles: gm.grouped_matmul(xs, w, sizes, interpret=smoke, tiles=t))
            got = np.asarray(run(xs, w, sizes))
            seconds = median_seconds(lambda: run(xs, w, sizes).block_until_ready(), repeats)  # noqa: B023
            rows.append({"rows": a, "experts_used": used, "tiles": dataclasses.asdict(tiles), "chosen": tiles == chosen,
                         "ms": 1e3 * seconds, "weight_gbps": used * hidden * ffn * 2 / seconds / 1e9,
                         "tflops": 2 * a * hidden * ffn / seconds / 1e12,
                         "agree": bool(np.allclose(got, want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max())))})
    return rows


def kimi_kernels_check(smoke: bool, repeats: int) -> list[dict]:
    """Kimi K2.5's two kernels against their references at its shapes: the paged MLA decode
    kernel (64 heads, 512 + 64 latent, pages out of order) and the int4 grouped matmul of its
    routed experts (7168 <-> 2048, eight experts a token)."""
    from jfire.kernels import int4_experts, mla_attention

    interpret = smoke
    impl = "pallas-interpret" if smoke else "pallas"
    b, h, c, r, page, pages, w = (2, 4, 32, 16, 4, 16, 4) if smoke else (16, 64, 512, 64, 16, 4096, 128)
    key = jax.random.key(11)
    cache = jax.random.normal(key, (2, pages, page, c + r), jnp.float32).astype(jnp.bfloat16)
    q_latent = jax.random.normal(jax.random.fold_in(key, 1), (b, h, c), jnp.float32).astype(jnp.bfloat16)
    q_rope = jax.random.normal(jax.random.fold_in(key, 2), (b, h, r), jnp.float32).astype(jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(0).permutation(pages)[: b * w].reshape(b, w).astype(np.int32))
    lengths = jnp.asarray(np.random.default_rng(1).integers(1, w * page + 1, b).astype(np.int32))
    scale = (128 + 64) ** -0.5
    kernel = jit(smoke)(lambda: mla_attention.mla_paged_decode(q_latent, q_rope, cache, 1, table, lengths,
                                                               scale=scale, interpret=interpret))
    reference = jit(smoke)(lambda: mla_attention.mla_partial_reference(
        q_latent[:, None], q_rope[:, None], cache, 1, table, (lengths - 1)[:, None], scale=scale))
    got = mla_attention.combine_partials(*kernel())
    want = mla_attention.combine_partials(*[x[:, 0] for x in reference()])
    rows = [{"kernel": "mla_paged_decode", "agree": bool(np.allclose(got, want, rtol=2e-2, atol=2e-2)),
             "kernel_ms": 1e3 * median_seconds(lambda: kernel()[0].block_until_ready(), repeats),
             "reference_ms": 1e3 * median_seconds(lambda: reference()[0].block_until_ready(), repeats)}]
    hidden, ffn, experts, tokens = (64, 64, 4, 4) if smoke else (7168, 2048, 48, 16)
    dense = 0.02 * np.random.default_rng(2).standard_normal((experts, ffn, hidden)).astype(np.float32)
    packed, scales = int4_experts.pack_int4(dense)
    packed, scales = jnp.asarray(packed), jnp.asarray(scales)
    sizes = jnp.asarray(np.bincount(np.random.default_rng(3).integers(0, experts, tokens * 8), minlength=experts)
                        .astype(np.int32))
    xs = jax.random.normal(jax.random.fold_in(key, 3), (tokens * 8, hidden), jnp.float32).astype(jnp.bfloat16)
    grouped = jit(smoke)(lambda: int4_experts.ragged_dot_int4(xs, packed, scales, sizes, impl=impl))
    xla = jit(smoke)(lambda: int4_experts.ragged_dot_int4(xs, packed, scales, sizes, impl="xla"))
    a, bb = np.asarray(grouped()), np.asarray(xla())
    rows.append({"kernel": "ragged_dot_int4", "agree": bool(np.allclose(a, bb, rtol=2e-2, atol=2e-2 * np.abs(bb).max())),
                 "kernel_ms": 1e3 * median_seconds(lambda: grouped().block_until_ready(), repeats),
                 "reference_ms": 1e3 * median_seconds(lambda: xla().block_until_ready(), repeats)})
    return rows


KIMI_CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "kimi-k2.5" / "config.json"


def kimi_layer_check(smoke: bool, repeats: int) -> list[dict]:
    """One Kimi K2.5-shaped MoE layer (tests/data/kimi-k2.5's config: 64 heads, q rank 1536,
    latent 512 + 64 rope, 384 int4 routed experts of width 2048 in groups of 32, 8 a token, one
    shared expert; bf16 elsewhere) decoding one token a row at batch 1 and 8 over a 4k-token
    cached context, through `mla.run_segment` as the model runs it, two ways: the engine's
    Pallas paths (the MLA decode kernel, `PallasAttention`, and the int4 expert kernel) and the
    XLA reference (jnp latent attention, int4 experts unpacked whole into ragged_dot: on CUDA
    about 34 GB of bf16 temporaries and a dense dot over every expert). The layer's update
    (output - input) must agree to bf16 rounding. The cache is not donated, so each call also
    copies it (8 x 4k tokens x 1,152 bytes: 38 MB, ~20 us on an H100)."""
    from jfire.kernels.int4_experts import use_impl
    from jfire.models import mla
    from jfire.models.deepseek import DeepseekV3Config
    from jfire.models.params import init_params
    from jfire.programs import PallasAttention

    cfg = dataclasses.replace(DeepseekV3Config.from_hf(json.loads(KIMI_CONFIG.read_text())), num_layers=1,
                              first_k_dense_replace=0)  # one routed-expert layer
    context, page = (24, 4) if smoke else (4096, 16)
    if smoke:
        cfg = dataclasses.replace(cfg, vocab_size=256, hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=32,
                                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=16,
                                  moe_intermediate_size=64)
    (segment,) = cfg.segments()
    specs = [s for s in cfg.param_specs() if s.name.startswith(segment.name + ".")]
    stack = jit(smoke)(lambda key: init_params(specs, key, jnp.bfloat16))(jax.random.key(29))[segment.name]
    expert_bytes = sum(stack[f"we_{p}"][k].nbytes for p in ("gate", "up", "down") for k in ("packed", "scale"))
    per_expert = expert_bytes // cfg.num_experts
    rows = []
    for batch in (1, 8):
        key = jax.random.fold_in(jax.random.key(31), batch)
        w = context // page + 1  # each row's pages, room for the token decoded
        pages = batch * w + 1
        cache = jax.random.normal(key, (1, pages, page, cfg.latent_width), jnp.float32).astype(jnp.bfloat16)
        table = jnp.asarray(np.random.default_rng(batch).permutation(pages)[: batch * w].reshape(batch, w)
                            .astype(np.int32))
        positions = jnp.full((batch, 1), context, jnp.int32)  # the token after a full context
        # Small inputs (the norms rescale them), so that the layer's update is not lost to the rounding of x + update.
        x = (0.01 * jax.random.normal(jax.random.fold_in(key, 1), (batch, 1, cfg.hidden_size))).astype(jnp.bfloat16)

        def layer(stack, x, cache, attention_impl, positions=positions, table=table):
            out, _ = mla.run_segment(cfg, segment, stack, x, positions, {"latent": cache}, table, 0, 0,
                                     attention_impl=attention_impl)
            return out.astype(jnp.float32) - x.astype(jnp.float32)

        def under(impl, attention_impl, x=x, cache=cache):
            run = jit(smoke)(functools.partial(layer, attention_impl=attention_impl))

            def call():
                with use_impl(impl):  # part of jit's cache key
                    return run(stack, x, cache).block_until_ready()
            return call

        kernel = under("pallas-interpret" if smoke else "pallas", PallasAttention(interpret=smoke))
        xla = under("xla", None)
        got, want = np.asarray(kernel(), np.float32), np.asarray(xla(), np.float32)
        t_kernel, t_xla = median_seconds(kernel, repeats), median_seconds(xla, repeats)
        # The experts the batch's rows chose (at most batch x 8 of 384), read once each, and the context's latents.
        read = min(cfg.num_experts, batch * cfg.experts_per_token) * per_expert + batch * context * cfg.latent_width * 2
        rows.append({"batch": batch, "context": context, "experts": cfg.num_experts, "kernel_ms": 1e3 * t_kernel,
                     "xla_ms": 1e3 * t_xla, "kernel_over_xla": t_kernel / t_xla,
                     "kernel_read_gbps_bound": read / t_kernel / 1e9,
                     "max_abs_error": float(np.abs(got - want).max()), "scale": float(np.abs(want).max()),
                     "agree": bool(np.allclose(got, want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max())))})
    return rows


def prefill_attention_check(smoke: bool, repeats: int) -> list[dict]:
    """The Pallas prefill flash kernel against the reference attention (blocks of pages, scores
    materialised) on one prompt's chunk from position 0, at Llama-3-8B's attention shapes (32
    heads over 8 KV heads of 128, bf16, pages of 16 out of order), 4k and 16k tokens."""
    from jfire.kernels.paged_attention import paged_attention_reference, paged_prefill_attention

    heads, kv_heads, dim, page = (4, 2, 32, 4) if smoke else (32, 8, 128, 16)
    rows = []
    for tokens in (64, 128) if smoke else (4096, 16384):
        key = jax.random.fold_in(jax.random.key(13), tokens)
        pages = tokens // page + 8
        shape = (1, kv_heads, pages, page, dim)
        k_pages = jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
        v_pages = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.float32).astype(jnp.bfloat16)
        q = jax.random.normal(jax.random.fold_in(key, 2), (1, tokens, heads, dim), jnp.float32).astype(jnp.bfloat16)
        table = jnp.asarray(np.random.default_rng(tokens).permutation(pages)[None, : tokens // page].astype(np.int32))
        positions = jnp.arange(tokens, dtype=jnp.int32)[None]
        args = (q, k_pages, v_pages, jnp.int32(0), table, positions)
        kernel = jit(smoke)(functools.partial(paged_prefill_attention, interpret=smoke))
        reference = jit(smoke)(paged_attention_reference)
        got, want = np.asarray(kernel(*args), np.float32), np.asarray(reference(*args), np.float32)
        t_kernel = median_seconds(lambda: kernel(*args).block_until_ready(), repeats)  # noqa: B023 (called here)
        t_reference = median_seconds(lambda: reference(*args).block_until_ready(), repeats)  # noqa: B023
        flops = 2 * 2 * heads * dim * tokens * (tokens + 1) / 2  # causal QK^T and PV
        rows.append({"tokens": tokens, "kernel": "paged_prefill_attention", "kernel_ms": 1e3 * t_kernel, "reference_ms": 1e3 * t_reference,
                     "kernel_tflops": flops / t_kernel / 1e12, "reference_tflops": flops / t_reference / 1e12,
                     "max_abs_error": float(np.abs(got - want).max()),
                     "agree": bool(np.allclose(got, want, rtol=2e-2, atol=2e-2))})
    rows.append(mla_prefill_check(smoke, repeats))
    return rows


def mla_prefill_check(smoke: bool, repeats: int) -> dict:
    """The latent-cache (MLA, absorbed form) prefill kernel against its reference at Kimi K2.5's
    shapes (64 heads, 512 + 64, bf16): a 2k-token chunk from position 0."""
    from jfire.kernels import mla_attention

    tokens, heads, c, r, page = (32, 4, 32, 16, 4) if smoke else (2048, 64, 512, 64, 16)
    key = jax.random.key(17)
    pages = tokens // page + 8
    cache = jax.random.normal(key, (1, pages, page, c + r), jnp.float32).astype(jnp.bfloat16)
    q_latent = jax.random.normal(jax.random.fold_in(key, 1), (1, tokens, heads, c), jnp.float32).astype(jnp.bfloat16)
    q_rope = jax.random.normal(jax.random.fold_in(key, 2), (1, tokens, heads, r), jnp.float32).astype(jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(5).permutation(pages)[None, : tokens // page].astype(np.int32))
    args = (q_latent, q_rope, cache, jnp.int32(0), table, jnp.arange(tokens, dtype=jnp.int32)[None])
    scale = (128 + 64) ** -0.5
    kernel = jit(smoke)(functools.partial(mla_attention.mla_paged_prefill, scale=scale, interpret=smoke))
    reference = jit(smoke)(functools.partial(mla_attention.mla_partial_reference, scale=scale))
    got = np.asarray(mla_attention.combine_partials(*kernel(*args)))
    want = np.asarray(mla_attention.combine_partials(*reference(*args)))
    t_kernel = median_seconds(lambda: kernel(*args)[0].block_until_ready(), repeats)
    t_reference = median_seconds(lambda: reference(*args)[0].block_until_ready(), repeats)
    flops = 2 * heads * (c + r + c) * tokens * (tokens + 1) / 2  # causal scores over c + r, values over c
    return {"tokens": tokens, "kernel": "mla_paged_prefill", "kernel_ms": 1e3 * t_kernel,
            "reference_ms": 1e3 * t_reference, "kernel_tflops": flops / t_kernel / 1e12,
            "reference_tflops": flops / t_reference / 1e12, "max_abs_error": float(np.abs(got - want).max()),
            "agree": bool(np.allclose(got, want, rtol=2e-2, atol=2e-2))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU-sized shapes, the kernel in interpret mode")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 10; smoke 1)")
    ap.add_argument("--output", default="gpu_check.json", help="where the JSON figures go")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    if not args.smoke:  # as `jfire serve` with --kv-cache-gb auto: before JAX starts its backend
        from jfire.device_memory import use_plan_allocator

        print(f"JAX allocator: {use_plan_allocator() or 'as the environment sets it'}", flush=True)
    print(f"jax {jax.__version__} on {jax.devices()[0]} ({jax.default_backend()})", flush=True)
    if args.smoke:  # one plain matrix, one stacked and transposed
        tensors = synthetic(TINY, "tiny", 0, only=("embed", "layers.wq"))
        decoders, kernel, repeats = ["reference", "pallas-interpret"], {"interpret": True}, args.repeats or 1
        configs = [(64, 4), (256, 4)]
    else:
        layers_8b = [spec.name for spec in LLAMA3_8B_2_LAYERS.param_specs() if spec.per_layer]
        tensors = synthetic(SMOLLM2_135M, "smollm2", 0) + synthetic(LLAMA3_8B_2_LAYERS, "llama3_8b", 1, only=layers_8b)
        decoders, kernel, repeats = ["reference", "pallas"], {}, args.repeats or 10
        configs = [(b, w) for b in (64, 128, 256, 512, 1024) for w in (1, 2, 4, 8)]
    print(f"{len(tensors)} tensors, {sum(b.nbytes for _, b, _ in tensors) / 1e9:.2f} GB of bf16", flush=True)

    encoded: dict = {}
    result = measure(tensors, decoders, repeats, encoded)
    result["units"] = check_units(tensors, encoded, kernel)
    name, bits, _ = max(tensors, key=lambda t: t[1].size)
    result["sweep"] = sweep(name, bits, encoded[name], configs, interpret=args.smoke, repeats=repeats)
    result["palette_matmul"] = palette_matmul_check(args.smoke, repeats)
    result["coded_layers"] = coded_layers_check(args.smoke, repeats)
    result["moe"] = moe_check(args.smoke, repeats)
    result["moe_tiles"] = moe_tiles_check(args.smoke, repeats)
    result["moe_scan"] = moe_scan_check(args.smoke, repeats)
    result["kimi_kernels"] = kimi_kernels_check(args.smoke, repeats)
    result["kimi_layer"] = kimi_layer_check(args.smoke, repeats)
    result["prefill_attention"] = prefill_attention_check(args.smoke, repeats)
    result["engine"] = engine_check(args.smoke, repeats)
    result["seconds"] = time.perf_counter() - start

    t = result["total"]
    exact = t["exact"] and all(r["exact"] for r in result["units"] + result["sweep"])
    exact = exact and all(r["agree"] for r in result["moe"] + result["kimi_kernels"] + [result["engine"]["kernel"]])
    exact = exact and all(r["agree"] for r in result["moe_tiles"] + result["palette_matmul"] + result["coded_layers"])
    exact = exact and all(r["agree"] for r in result["prefill_attention"] + result["kimi_layer"])
    best = max(result["sweep"], key=lambda r: r["gbps"])
    print(f"compression ratio {t['ratio']:.4f}; encode {t['encode_gbps']:.3f} GB/s (host)")
    for d in decoders:
        print(f"decode {d:<16} {t[f'{d}_gbps']:8.4g} GB/s of bf16 out ({t[f'{d}_gbps'] / t['copy_gbps']:.3f} x copy)")
    print(f"device copy             {t['copy_gbps']:8.4g} GB/s")
    print(f"best tile on {best['name']}: block_lanes={best['block_lanes']} num_warps={best['num_warps']} "
          f"{best['gbps']:.4g} GB/s")
    for r in result["palette_matmul"]:
        print(f"palette matmul {r['shape'][0]}x{r['shape'][1]} (k={r['k']}, {r['ratio']:.3f} of bf16), batch {r['batch']:>2}: "
              f"fused {r['fused_ms']:8.3f} ms ({r['fused_read_gbps']:.0f} GB/s coded), bf16 dot {r['bf16_dot_ms']:8.3f} ms "
              f"({r['bf16_read_gbps']:.0f} GB/s), fused/bf16 {r['fused_over_bf16']:.2f}, agree: {'yes' if r['agree'] else 'NO'}")
    for r in result["coded_layers"]:
        fused_rows = sorted(set(r["fused_max_rows"].values()))
        print(f"8B-shaped layers, batch {r['batch']:>2}: plain {r['plain_tokens_per_s']:9.1f} tok/s, kept coded (decoded "
              f"per layer) {r['kept_tokens_per_s']:9.1f}, fused where faster (up to {fused_rows} rows) "
              f"{r['fused_tokens_per_s']:9.1f}; layers {r['kept_layer_bytes'] / r['plain_layer_bytes']:.3f} of bf16, "
              f"agree: {'yes' if r['agree'] else 'NO'}")
    for r in result["moe"]:
        print(f"MoE layer, {r['tokens']:>4} tokens: Pallas grouped {r['kernel_ms']:8.3f} ms "
              f"({r['kernel_weight_gbps']:.0f} GB/s of used experts), XLA ragged_dot {r['xla_ragged_dot_ms']:8.3f} ms, "
              f"dense all-experts {r['dense_ms']:8.3f} ms, agree: {'yes' if r['agree'] else 'NO'}")
    r = result["moe_scan"]
    print(f"MoE layers in a scan, 1 token: {r['ms_per_layer']:8.3f} ms a layer; a layer's experts "
          f"({r['layer_expert_bytes'] / 1e9:.2f} GB) copied out of the stack: {'YES' if r['layer_copied'] else 'no'} "
          f"(temporaries {r['temp_bytes'] / 1e9:.2f} GB)")
    for r in result["moe_tiles"]:
        t = r["tiles"]
        print(f"grouped matmul {r['rows']:>4} rows, tiles {t['rows']}x{t['out']}x{t['inner']} split {t['k_splits']} "
              f"warps {t['num_warps']} stages {t['num_stages']}{' (chosen)' if r['chosen'] else ''}: {r['ms']:8.3f} ms, "
              f"{r['weight_gbps']:.0f} GB/s, {r['tflops']:.1f} TF/s, agree: {'yes' if r['agree'] else 'NO'}")
    for r in result["kimi_kernels"]:
        print(f"{r['kernel']:<18} {r['kernel_ms']:8.3f} ms against its reference {r['reference_ms']:8.3f} ms, "
              f"agree: {'yes' if r['agree'] else 'NO'}")
    for r in result["kimi_layer"]:
        print(f"Kimi K2.5 MoE layer decode, batch {r['batch']} at {r['context']:,} tokens: Pallas (MLA + int4) "
              f"{r['kernel_ms']:8.3f} ms (<= {r['kernel_read_gbps_bound']:.0f} GB/s of experts + latents), "
              f"XLA reference {r['xla_ms']:8.3f} ms, agree: {'yes' if r['agree'] else 'NO'} "
              f"(max |error| {r['max_abs_error']:.3g} of {r['scale']:.3g})")
    for r in result["prefill_attention"]:
        print(f"{r['kernel']:<23} {r['tokens']:>5} tokens: kernel {r['kernel_ms']:8.3f} ms "
              f"({r['kernel_tflops']:.1f} TF/s), reference {r['reference_ms']:8.3f} ms "
              f"({r['reference_tflops']:.1f} TF/s), agree: {'yes' if r['agree'] else 'NO'}")
    for line in summary(result["engine"]):
        print(line)
    print(f"bit-exact (whole tensors, single layers, every tile) and MoE paths agree: {'yes' if exact else 'NO'}; "
          f"{result['seconds']:.0f} s")
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
