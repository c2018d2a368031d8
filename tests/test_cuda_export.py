"""Every program the engine compiles, lowered for CUDA on this CPU-only machine.

For the tiny model of each family (dense Llama variants, Mixtral, Llama 4, DeepSeek-V3 with its
routed experts FP8, Kimi K2.5 with them int4) the decode program and a prefill program are
built as an engine on one GPU builds them: by `CompiledPrograms.program` (the very function,
abstract arguments and static arguments the engine compiles), over params and pages given as
shapes only (bf16, and float32, the CLI's default), with no CPU kernels
(`runner.uses_cpu_kernels` is False off a CPU device) and `jax.default_backend()` answering
"gpu" while they are traced, as it does there (the experts' grouped matmuls and the decoders of layers kept
compressed choose their Pallas kernels by it). Decode is built with `--attention pallas` and
with the default, `reference`; the prefill program is one bucket of 2 rows x 16 tokens, built
with the default and, for a dense family, Mistral's window, Llama 4 and the MLA families,
`--attention pallas`. Tiny
Llama is also built from a compressed checkpoint kept compressed (`--keep-compressed`, Huffman
and palette codecs). Each program is exported with `jax.export` for platforms=["cuda"]:
lowering needs no GPU, and nothing here is compiled.

What it proves, per program:
  - it lowers for CUDA (a lowering that breaks fails here, not on the first GPU it meets);
  - the GPU path is the one listed in CASES, exactly: each Pallas kernel by name (a Triton
    custom call, or a Mosaic GPU one), and XLA's ragged_dot where it serves the experts. A
    Pallas path that fell back to plain jnp, or a new kernel or fallback, fails until listed;
  - no jfire CPU FFI kernel (jfire.kernels.cpu_matmul.TARGETS), nor any custom call but the
    GPU kernels', is in it (`jax.export` would also refuse an unknown one);
  - quantized experts reach the program quantized (FP8 codes, packed int4 words), and the
    outputs have the engine's shapes.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jfire.kernels import cpu_matmul
from jfire.kv_cache import init_pages
from jfire.models.params import abstract_params, get_path, set_path
from jfire.models.registry import config_from_hf
from jfire.programs import Buckets, CompiledPrograms
from jfire.sampling import init_penalty_state
from tests.tiny_models import tiny_hf_config

TRITON = "__gpu$xla.gpu.triton"
MOSAIC_GPU = ("mosaic_gpu", "mosaic_gpu_v2")
EXPORT_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]

# The GPU path's parts as `gpu_path` names them.
PAGED = "triton:jfire_paged_decode_attention"  # jfire.kernels.paged_attention
MLA = "triton:jfire_mla_paged_decode"  # jfire.kernels.mla_attention
INT4 = "triton:jfire_ragged_dot_int4"  # jfire.kernels.int4_experts
RAGGED = "xla:ragged_dot"  # XLA's grouped matmul (`use_impl("xla")`): no program takes it on a GPU
GROUPED = "triton:jfire_grouped_matmul"  # bf16 / f32 experts (jfire.kernels.grouped_matmul)
GROUPED_FP8 = "triton:jfire_grouped_matmul_fp8"  # FP8 experts, scaled as read (jfire.kernels.grouped_matmul)
BF16_DECODE = "triton:jfire_bf16_decode"  # layers kept Huffman-coded (jfire.kernels.bf16_decode)
PALETTE = "triton:jfire_palette_decode"  # layers kept palette-coded (jfire.kernels.palette_matmul)
PREFILL = "triton:jfire_paged_prefill_attention"  # prefill chunks with --attention pallas (GQA families)
MLA_PREFILL = "triton:jfire_mla_paged_prefill"  # prefill chunks with --attention pallas (MLA families)

# The released checkpoints' quantization configs (as tests/models/test_deepseek_fp8.py and
# test_kimi_k25.py write them): the routed experts stay FP8 / packed int4 on the device.
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
INT4_QUANT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
}  # fmt: skip


def hf_config(case: str) -> dict:
    """The config.json of a case's tiny model (tests/tiny_models.py), as released."""
    family = case.partition("+")[0]
    if family == "deepseek_v3_fp8":
        return {**tiny_hf_config("deepseek_v3").to_dict(), "quantization_config": FP8_QUANT}
    if family == "kimi_k25_int4":
        text = {**tiny_hf_config("kimi_k2").to_dict(), "model_type": "kimi_k2"}
        return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                "text_config": text, "quantization_config": INT4_QUANT}  # fmt: skip
    return tiny_hf_config(family).to_dict()


# case -> the GPU path of (decode with --attention pallas, decode with the reference attention,
# prefill with the reference attention). A case
# "family+codec" is a compressed checkpoint loaded with --keep-compressed: its coded layers are
# decoded in the layer loop.
CASES = {
    "llama3": ({PAGED}, set(), set()),  # llama3 rope scaling
    "mistral": ({PAGED}, set(), set()),  # a sliding window
    "smollm2": ({PAGED}, set(), set()),  # tied embeddings, one KV head
    "qwen3": ({PAGED}, set(), set()),  # q/k norms, head_dim unlike hidden / heads
    "mixtral": ({PAGED, GROUPED}, {GROUPED}, {GROUPED}),
    "llama4": ({PAGED, GROUPED}, {GROUPED}, {GROUPED}),  # NoPE and chunked layers, shared expert
    "deepseek_v3_fp8": ({MLA, GROUPED_FP8}, {GROUPED_FP8}, {GROUPED_FP8}),  # FP8 experts read as FP8
    "kimi_k25_int4": ({MLA, INT4}, {INT4}, {INT4}),
    "llama3+huffman": ({PAGED, BF16_DECODE}, {BF16_DECODE}, {BF16_DECODE}),
    "llama3+palette": ({PAGED, PALETTE}, {PALETTE}, {PALETTE}),
}
PROGRAMS = ("decode-pallas", "decode-reference", "prefill")
DECODE_ROWS, PREFILL_ROWS, PREFILL_TOKENS, PAGE_SIZE, NUM_PAGES = 4, 2, 16, 16, 16
BUCKETS = Buckets.for_limits(
    max_batch=DECODE_ROWS, prefill_budget=2 * PREFILL_TOKENS, max_prefill_rows=PREFILL_ROWS, max_pages_per_row=4,
    page_size=PAGE_SIZE,
)  # fmt: skip


def engine_programs(cfg, attention: str, params, dtype) -> CompiledPrograms:
    """The programs of a one-GPU engine, from shapes alone (`runner.ModelRunner` builds them
    from the loaded params and its page pool the same way)."""
    pages = jax.eval_shape(functools.partial(init_pages, cfg, NUM_PAGES, PAGE_SIZE, dtype))
    penalties = jax.eval_shape(functools.partial(init_penalty_state, DECODE_ROWS + 1, cfg.vocab_size))
    return CompiledPrograms(cfg, params, pages, penalties, BUCKETS, attention, cpu_matmul=False)


def kept_compressed(case: str, dtype) -> dict:
    """The params' shapes as `load_model(..., keep_compressed=True)` holds a compressed checkpoint
    (`jfire.checkpoint.compressed.decode_tree`): per-layer tensors the codec coded stay
    `Compressed` / `Palette`, decoded in the layer loop by their Pallas kernel; the rest are
    decoded into `dtype` on load."""
    from jfire.checkpoint import compressed
    from jfire.kernels.bf16_decode import Compressed, Layout
    from jfire.kernels.palette_matmul import Palette, PaletteLayout

    family, _, codec = case.partition("+")
    cfg = config_from_hf(hf_config(family))
    rng, weights = np.random.default_rng(0), {}
    for spec in cfg.param_specs():  # random bf16 weights (numpy: jax.random compiles a program per shape)
        set_path(weights, spec.name, (0.02 * rng.standard_normal(spec.shape)).astype(ml_dtypes.bfloat16))
    section = compressed.compress_params(cfg, weights, codec_name=codec)[1]
    specs = cfg.param_specs()
    stored = compressed.abstract_tree(specs, section, None)  # the coded arrays' shapes
    params: dict = {}
    for spec in specs:
        entry, arrays = section["tensors"][spec.name], get_path(stored, spec.name)
        if entry["stored"] == "huffman" and spec.per_layer:
            leaf = Compressed(layout=Layout.from_dict(entry["layout"]), **arrays)
        elif entry["stored"] == "palette" and spec.per_layer:
            leaf = Palette(layout=PaletteLayout.from_dict(entry["layout"]), **arrays)
        else:
            leaf = jax.ShapeDtypeStruct(spec.shape, spec.dtype or dtype)
        set_path(params, spec.name, leaf)
    return params


def custom_calls(text: str) -> list[tuple[str, str]]:
    """(target, kernel name or "") of every custom call in a StableHLO module's text."""
    out = []
    for line in text.splitlines():
        m = re.search(r"custom_call @([\w$.]+)", line)
        if m:
            config = re.sub(r'ir = "(?:[^"\\]|\\.)*"', "", line)  # the kernel's own IR may hold anything
            name = re.search(r'name = "([^"]*)"', config)
            out.append((m.group(1), name.group(1) if name else ""))
    return out


def gpu_path(text: str) -> set[str]:
    """The Pallas kernels a program calls ("triton:NAME", "mosaic_gpu:NAME"), and "xla:ragged_dot"
    where XLA's grouped matmul runs."""
    path = set()
    for target, name in custom_calls(text):
        if target == TRITON:
            path.add(f"triton:{name}")
        elif target in MOSAIC_GPU:
            path.add(f"mosaic_gpu:{name}")
    if re.search(r"\bchlo\.ragged_dot\b", text):
        path.add(RAGGED)
    return path


# Entered while tracing as on a GPU host: a jax user context is part of jit's cache key, so a
# trace made here is never reused on this CPU host, nor one made there reused here.
_GPU_HOST = jax.make_user_context(default_value=False)


@pytest.fixture
def on_gpu_host(monkeypatch):
    """Tracing sees what it sees on a GPU host: jax.default_backend() is "gpu"."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with _GPU_HOST(True):
        yield


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("case", CASES)
def test_program_exports_for_cuda_on_its_gpu_path(case, program, dtype, on_gpu_host):
    cfg = config_from_hf(hf_config(case))
    params = kept_compressed(case, dtype) if "+" in case else abstract_params(cfg.param_specs(), dtype)
    programs = engine_programs(cfg, "pallas" if program == "decode-pallas" else "reference", params, dtype)
    shape = ("decode", DECODE_ROWS) if program.startswith("decode") else ("prefill", PREFILL_ROWS, PREFILL_TOKENS)
    fn, args, static = programs.program(shape)
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=EXPORT_CHECKS)(*args, **static)
    text = exported.mlir_module()

    assert exported.platforms == ("cuda",)
    assert gpu_path(text) == CASES[case][PROGRAMS.index(program)]
    targets = {target for target, _ in custom_calls(text)}
    assert targets <= {TRITON, *MOSAIC_GPU}, f"custom calls other than GPU kernels: {targets}"
    assert not [t for t in cpu_matmul.TARGETS if t in text], "a jfire CPU kernel in a CUDA program"
    # (SampleOut, logits [b, v], penalties, pages): the logits, and the pages handed back whole.
    rows = shape[1]
    out_shapes = [a.shape for a in exported.out_avals]
    assert (rows, cfg.vocab_size) in out_shapes
    page_shapes = [p.shape for p in jax.tree.leaves(args[1])]
    assert out_shapes[-len(page_shapes) :] == page_shapes

    if case in ("deepseek_v3_fp8", "kimi_k25_int4"):
        experts = args[0]["layers"]["we_gate"]  # [moe layers, experts, out, in] in the source's form
        quantized = experts["fp8"] if case == "deepseek_v3_fp8" else experts["packed"]
        assert quantized.dtype == (jnp.float8_e4m3fn if case == "deepseek_v3_fp8" else jnp.int32)
        assert any(a.shape == quantized.shape and a.dtype == quantized.dtype for a in exported.in_avals)


# Prefill built with --attention pallas: the Pallas prefill kernel on top of the reference
# prefill's path (a dense family, a sliding window, Llama 4's chunked and NoPE cache groups, and
# the latent-cache kernel of the MLA families).
PREFILL_PALLAS = {"llama3": {PREFILL}, "mistral": {PREFILL}, "llama4": {PREFILL}, "deepseek_v3_fp8": {MLA_PREFILL},
                  "kimi_k25_int4": {MLA_PREFILL}}  # fmt: skip


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", PREFILL_PALLAS)
def test_prefill_with_pallas_attention_exports_for_cuda(case, dtype, on_gpu_host):
    cfg = config_from_hf(hf_config(case))
    programs = engine_programs(cfg, "pallas", abstract_params(cfg.param_specs(), dtype), dtype)
    fn, args, static = programs.program(("prefill", PREFILL_ROWS, PREFILL_TOKENS))
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=EXPORT_CHECKS)(*args, **static)
    text = exported.mlir_module()
    assert gpu_path(text) == CASES[case][2] | PREFILL_PALLAS[case]
    assert {target for target, _ in custom_calls(text)} <= {TRITON, *MOSAIC_GPU}
    assert (PREFILL_ROWS, cfg.vocab_size) in [a.shape for a in exported.out_avals]


# The expert-parallel dispatch (`moe.experts_parallel`: experts over ep, their width over tp, one
# psum) with each kind of expert weight, over an abstract tp=2 x ep=2 mesh: the grouped-matmul
# kernels inside its shard_map (operands varying alike, the output's varying axes stated). JAX
# 0.10.2's Pallas interpreter fails there, so this export is that path's check on a CPU.
EP_KERNELS = {"bf16": GROUPED, "fp8": GROUPED_FP8, "int4": INT4}


@pytest.mark.parametrize("kind", EP_KERNELS)
def test_expert_parallel_kernels_export_for_cuda(kind, on_gpu_host):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jfire.models import moe

    mesh = jax.sharding.AbstractMesh((2, 2), ("tp", "ep"))
    experts, hidden, ffn, tokens, top_k = 4, 256, 256, 3, 2
    s = jax.ShapeDtypeStruct

    def weight(out, n_in, width):  # one expert linear in its kind's layout, sharded as the model's
        if kind == "bf16":
            w = s((experts, n_in, out), jnp.bfloat16)
        elif kind == "fp8":
            w = {"fp8": s((experts, out, n_in), jnp.float8_e4m3fn),
                 "scale_inv": s((experts, out // 128, n_in // 128), jnp.float32)}  # fmt: skip
        else:
            w = {"packed": s((experts, out, n_in // 8), jnp.int32), "scale": s((experts, out, n_in // 32), jnp.bfloat16)}
        spec = moe._expert_spec(w, width, "ep", "tp")
        return jax.tree.map(lambda a, p: s(a.shape, a.dtype, sharding=NamedSharding(mesh, p)), w, spec)

    tokens_in = [s(shape, dtype, sharding=NamedSharding(mesh, P()))
                 for shape, dtype in [((tokens, hidden), jnp.bfloat16), ((tokens, top_k), jnp.float32),
                                      ((tokens, top_k), jnp.int32)]]  # fmt: skip
    weights = [weight(ffn, hidden, "in_out"), weight(ffn, hidden, "in_out"), weight(hidden, ffn, "out_in")]
    layer = jax.jit(lambda *a: moe.experts_parallel(*a, mesh=mesh, scale_input=False))
    exported = jax.export.export(layer, platforms=["cuda"], disabled_checks=EXPORT_CHECKS)(*tokens_in, *weights)
    text = exported.mlir_module()
    assert exported.nr_devices == 4
    assert gpu_path(text) == {EP_KERNELS[kind]}


def test_long_mla_prefill_exports_the_expanded_form_for_cuda(on_gpu_host):
    """A chunk long enough for jfire.models.mla.prefill_expanded (32 tokens after at most 32
    cached at the tiny model's widths) takes the expanded MLA kernel, and lowers for CUDA."""
    from jfire.models.mla import prefill_expanded
    from jfire.programs import PallasAttention

    cfg = config_from_hf(hf_config("deepseek_v3_fp8"))
    assert prefill_expanded(cfg, PallasAttention(), 32, 4 * PAGE_SIZE)
    buckets = Buckets.for_limits(max_batch=DECODE_ROWS, prefill_budget=32, max_prefill_rows=1, max_pages_per_row=4,
                                 page_size=PAGE_SIZE)  # fmt: skip
    pages = jax.eval_shape(functools.partial(init_pages, cfg, NUM_PAGES, PAGE_SIZE, jnp.bfloat16))
    penalties = jax.eval_shape(functools.partial(init_penalty_state, DECODE_ROWS + 1, cfg.vocab_size))
    params = abstract_params(cfg.param_specs(), jnp.bfloat16)
    programs = CompiledPrograms(cfg, params, pages, penalties, buckets, "pallas", cpu_matmul=False)
    fn, args, static = programs.program(("prefill", 1, 32))
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=EXPORT_CHECKS)(*args, **static)
    assert "jfire_mla_expanded_prefill" in exported.mlir_module()
    assert gpu_path(exported.mlir_module()) == CASES["deepseek_v3_fp8"][2] | {"triton:jfire_mla_expanded_prefill"}
