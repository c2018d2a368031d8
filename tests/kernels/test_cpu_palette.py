"""The CPU's palette-coded weights (jfire.kernels.cpu_palette): the coded form decodes to the
source bits; products from it equal the bfloat16 kernel's on the same weight bit for bit (every
build, row counts through the panel sizes, several stacks a call, blocks split between threads,
blocks with and without exceptions); and an engine serving the coded form gives the bfloat16
engine's tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.kernels import cpu_matmul, cpu_palette


def bf16_stack(rng, shape, wide: bool) -> np.ndarray:
    """Normal values; `wide`: each scaled by 2^-12 .. 2^11, so most blocks hold exponents their
    16-entry palette lacks (exceptions), where plain normal values leave almost none."""
    w = rng.standard_normal(shape).astype(np.float32)
    if wide:
        w *= 2.0 ** rng.integers(-12, 12, shape)
    return np.asarray(jnp.asarray(w, jnp.bfloat16))


@pytest.mark.parametrize("wide", [False, True])
def test_the_coded_form_decodes_to_the_source_bits(wide):
    rng = np.random.default_rng(wide)
    stack = bf16_stack(rng, (3, 160, 4, 48), wide)  # [layers, in, heads, dim]: n = 192
    coded = cpu_palette.encode(stack, 1)
    exceptions = int(np.asarray(coded.exc_start)[:, -1].sum())
    assert (exceptions > stack.size // 20) if wide else (exceptions < stack.size // 1000)
    assert coded.nbytes < 0.76 * stack.nbytes + 4 * (exceptions + 64)
    decode = jax.jit(lambda i: coded.layer(i))
    for layer in range(3):
        np.testing.assert_array_equal(np.asarray(decode(layer)).view(np.uint16), stack[layer].view(np.uint16))


@pytest.mark.parametrize("wide", [False, True])
def test_the_native_encoder_writes_the_numpy_encoders_bytes(wide):
    rng = np.random.default_rng(10 + wide)
    stack = bf16_stack(rng, (2, 96, 3, 64), wide)  # n_in 1: k = 96, n = 192
    native, reference = cpu_palette.encode(stack, 1), cpu_palette.encode_reference(stack, 1)
    for a, b in zip(jax.tree.leaves(native), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# k = 160 splits over two threads at row 80, inside a block; k = 576, 1536: the default model's.
@pytest.mark.parametrize("k,n", [(576, 192), (1536, 128), (160, 64)])
def test_products_equal_the_bfloat16_kernels_bits(k, n, kernel_build):
    rng = np.random.default_rng(k + n)
    stacks = [bf16_stack(rng, (2, k, n), wide=False), bf16_stack(rng, (2, k, 2 * n), wide=True)]
    coded = [cpu_palette.encode(s, 1) for s in stacks]
    plain = [jnp.asarray(s) for s in stacks]
    from_codes, from_bf16 = jax.jit(cpu_palette.stacked_matmuls), jax.jit(cpu_matmul.stacked_matmuls)
    for m in (1, 2, 5, 9, 16, 36):
        x = rng.standard_normal((m, k)).astype(np.float32)
        for layer in range(2):
            got = from_codes(x, coded, jnp.int32(layer))
            want = from_bf16(x, plain, jnp.int32(layer))
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"m={m} layer={layer}")


def test_a_layer_scan_reads_coded_stacks_in_place_and_decoded():
    """Through the models' own path (`layer_matmuls` on a `StackedLayer` inside a scan over
    layer ids): rows the kernel takes multiply the coded stack, longer products decode the
    layer first; both give the bfloat16 stack's bits."""
    from jfire.models.blocks import layer_matmuls
    from jfire.models.family import StackedLayer

    rng = np.random.default_rng(3)
    stack = bf16_stack(rng, (4, 64, 128), wide=True)
    coded, plain = {"w": cpu_palette.encode(stack, 1)}, {"w": jnp.asarray(stack)}

    def run(stacks, x):
        step = lambda h, j: (h, layer_matmuls(h, StackedLayer(stacks, j), ("w",))[0])  # noqa: E731
        return jax.lax.scan(step, x, jnp.arange(4, dtype=jnp.int32))[1]

    with cpu_matmul.in_place(True):
        for rows in (3, cpu_matmul.BF16_MAX_ROWS + 8):
            x = rng.standard_normal((rows, 64)).astype(np.float32)
            np.testing.assert_array_equal(np.asarray(jax.jit(run)(coded, x)), np.asarray(jax.jit(run)(plain, x)))


def test_an_engine_on_coded_weights_gives_the_bfloat16_engines_tokens(tiny_hf_dir):
    """A tiny Llama in bfloat16 loaded with keep_compressed (its layer weights coded but for
    wk and wv, too narrow for whole blocks) gives the plain bfloat16 engine's tokens, greedy
    and sampled, batched, a prompt in several chunks."""
    from jfire.checkpoint.load import load_model
    from jfire.engine import Engine, EngineConfig
    from jfire.sampling import SamplingParams

    path = str(tiny_hf_dir("llama3"))
    coded = load_model(path, "bfloat16", keep_compressed=True)
    layers = coded.params["layers"]
    assert isinstance(layers["w_up"], cpu_palette.CpuPalette) and isinstance(layers["wo"], cpu_palette.CpuPalette)
    assert not isinstance(layers["wk"], cpu_palette.CpuPalette)
    config = EngineConfig(
        max_batch=4,
        max_prefill_rows=2,
        prefill_budget=16,
        max_model_len=64,
        num_pages=32,
        aot=False,
        quick_compile=True,
    )
    requests = [
        ([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
        ([11, 12], SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)),
        (list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
    ]

    def run(model):
        with Engine(model, config) as engine:
            return [c.token_ids for c in engine.generate(requests)]

    assert run(coded) == run(load_model(path, "bfloat16"))
