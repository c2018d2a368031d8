"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in float32 against transformers
loading the same GGUF: identical greedy tokens for 32 steps, plain and chat prompts, and the
same logits at every position."""

from __future__ import annotations

import inspect

import jax
import numpy as np
import pytest
import torch
import transformers

from jfire.checkpoint.default_model import default_gguf_path
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.sampling import SamplingParams

STEPS = 32
# transformers 5.25 renamed the forward's `past_key_values` (and the output's) to `cache`; the
# old name goes in 5.40. Either version runs the same cached loop.
CACHE = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"


@pytest.fixture(scope="module")
def reference(default_hf_reference):
    return default_hf_reference


@pytest.fixture(scope="module")
def jfire_model(default_checkpoint):
    return load_model("default", "float32")


def hf_greedy(model, prompt_ids: list[int], steps: int) -> list[int]:
    """A plain cached greedy loop in transformers, no EOS handling: 32 ids, always."""
    out = []
    with torch.no_grad():
        result = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(steps):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), **{CACHE: getattr(result, CACHE)}, use_cache=True)
    return out


@pytest.mark.parametrize("kind", ["plain", "chat"])
def test_default_model_greedy_matches_transformers(kind, reference, jfire_model):
    tok, model = reference
    if kind == "plain":
        ids = tok("The three most important inventions in history are", add_special_tokens=True)["input_ids"]
        assert ids == jfire_model.tokenizer.encode("The three most important inventions in history are")
    else:
        messages = [{"role": "user", "content": "Write a haiku about the sea."}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == jfire_model.tokenizer.encode_chat(messages)
    expected = hf_greedy(model, ids, STEPS)
    with Engine(jfire_model, EngineConfig(max_batch=1, max_prefill_rows=1, aot=False)) as engine:
        got = engine.generate([(ids, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))])[0]
    assert got.token_ids == expected


def test_checkpoint_holds_the_gguf_weights_exactly(jfire_model):
    """The converted checkpoint restores bit-for-bit what reading the GGUF directly gives."""
    direct = load_model(str(default_gguf_path()), "float32")
    assert direct.config == jfire_model.config
    equal = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), direct.params, jfire_model.params)
    assert all(jax.tree.leaves(equal))


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["xla-dots", "cpu-matmul-kernels"])
def test_default_model_logits_match_transformers_per_position(reference, jfire_model, cpu_kernels):
    """Every position's logits of a prompt plus a greedy continuation, uncached in both; with
    XLA's dots and with the CPU kernels reading each layer's weights from the stack."""
    import jax.numpy as jnp

    from jfire.kernels import cpu_matmul
    from jfire.models.family import forward, init_cache

    tok, model = reference
    ids = tok("The three most important inventions in history are", add_special_tokens=True)["input_ids"]
    ids = ids + hf_greedy(model, ids, 8)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    cfg = jfire_model.config
    assert len(ids) <= cpu_matmul.MAX_ROWS and (not cpu_kernels or cpu_matmul.available())
    with cpu_matmul.in_place(cpu_kernels):
        got, _ = forward(jfire_model.params, cfg, jnp.asarray([ids], jnp.int32), jnp.arange(len(ids))[None],
                         init_cache(cfg, 1, len(ids), jnp.float32))
    got = np.asarray(got[0])
    for t in range(len(ids)):
        err = np.linalg.norm(got[t] - want[t]) / np.linalg.norm(want[t])
        assert err < 1e-4, f"position {t}: relative error {err:.2e}"
