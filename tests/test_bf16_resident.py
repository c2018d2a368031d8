"""bfloat16 weights on the CPU (`--dtype bfloat16`): held in memory as bfloat16, computed in
float32 (jfire.checkpoint.load.LoadedModel.kv_dtype). The check is against an independent run
of the same values: a float32 engine whose weights are the default model's rounded to
bfloat16 and widened back. The CPU kernels widen a bfloat16 weight exactly and sum in the
float32 order, and every other product converts it exactly before XLA's float32 dot, so both
engines must give the same greedy tokens and the same logprobs, bit for bit: a prompt several
prefill chunks long, batched decode (the kernels' register blocks) and one row alone (their
streamed form)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jfire.checkpoint.load import load_model
from jfire.engine import Engine
from jfire.kernels import cpu_matmul
from jfire.sampling import SamplingParams
from tests.limits import serve_engine_config

PROMPTS = [
    "The capital of France is",
    "Here is a long story about a lighthouse keeper who kept a diary of every ship that passed " * 8,
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def models(default_checkpoint):
    bf16 = load_model("default", "bfloat16")
    widened = load_model("default", "float32")
    widened.params = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), widened.params)
    return bf16, widened


def run(model, requests):
    with Engine(model, serve_engine_config()) as engine:
        together = engine.generate(requests)
        alone = engine.generate(requests[:1])
        handles = [engine.submit(ids, sp) for ids, sp in requests]
        logprobs = [[lp for out in h for lp in (out.logprobs or [])] for h in handles]
    return [c.token_ids for c in together], alone[0].token_ids, logprobs


def test_bf16_weights_compute_in_float32_with_the_widened_weights_bits(models):
    bf16, widened = models
    assert cpu_matmul.available()
    assert bf16.kv_dtype == jnp.float32 and bf16.params["embed"].dtype == jnp.bfloat16
    leaves = jax.tree.leaves(bf16.params)
    assert sum(w.nbytes for w in leaves) * 2 == sum(w.nbytes for w in jax.tree.leaves(widened.params))
    tok = bf16.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    requests = [(tok.encode(p), greedy) for p in PROMPTS]
    assert max(len(ids) for ids, _ in requests) > 2 * serve_engine_config().prefill_budget
    got, want = run(bf16, requests), run(widened, requests)
    assert got == want
