"""Logits parity with HF transformers (torch, CPU, float32) for every supported family.

Each tiny random model is saved as a HF directory, loaded by jfire from disk, and compared
with transformers loading the same directory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.models.family import forward, init_cache
from jfire.sampling import SamplingParams
from tests import greedy_programs
from tests.tiny_models import ALL_FAMILIES, hf_text_model

PROMPT_LEN = 20  # past two of the tiny Llama 4's 8-token attention chunks
DECODE_STEPS = 8
GREEDY_STEPS = 16


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def assert_close_per_position(got, want, tol=1e-4, what=""):
    """Each position's logits within tol relative error: one bad position cannot hide among good ones."""
    got, want = np.atleast_2d(np.asarray(got)), np.atleast_2d(np.asarray(want))
    for t in range(want.shape[0]):
        err = rel_err(got[t], want[t])
        assert err < tol, f"{what} position {t}: relative error {err:.2e}"


def hf_model(path):
    return hf_text_model(path)


def hf_logits(model, ids) -> np.ndarray:
    """Uncached logits [t, v] of the whole sequence: the independent reference."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("family", sorted(ALL_FAMILIES))
def test_prefill_and_decode_logits_match_transformers(family, tiny_hf_dir):
    path = tiny_hf_dir(family)
    ref_model = hf_model(path)
    model = load_model(str(path), "float32")
    cfg, params = model.config, model.params
    prompt = list(np.random.RandomState(1).randint(3, cfg.vocab_size, size=PROMPT_LEN))

    # Prefill: every position's logits.
    cache = init_cache(cfg, 1, 64, jnp.float32)
    prefill = greedy_programs.quick(forward, static_argnums=1)
    logits, _ = prefill(params, cfg, jnp.asarray([prompt]), jnp.arange(PROMPT_LEN)[None], cache)
    assert_close_per_position(logits[0], hf_logits(ref_model, prompt), what="prefill")

    # Decode through the compiled programs, checking each step's logits against HF recomputing
    # the whole sequence from scratch.
    cache = init_cache(cfg, 1, 64, jnp.float32)
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :PROMPT_LEN] = prompt
    positions = np.full((1, 32), -1, np.int32)
    positions[0, :PROMPT_LEN] = np.arange(PROMPT_LEN)
    table = cache.pop("page_table")
    ids, step_logits, cache = greedy_programs.prefill(
        params, cache, jnp.asarray(tokens), jnp.asarray(positions), table, jnp.asarray([PROMPT_LEN - 1]), cfg=cfg)
    seq = list(prompt)
    for step in range(DECODE_STEPS):
        ref = hf_logits(ref_model, seq)[-1]
        assert_close_per_position(step_logits[0], ref, what=f"decode step {step}")
        assert int(ids[0]) == int(np.argmax(ref))
        seq.append(int(ids[0]))
        ids, step_logits, cache = greedy_programs.decode(
            params, cache, ids, jnp.asarray([len(seq) - 1], jnp.int32), table, cfg=cfg)


@pytest.mark.parametrize("family", sorted(ALL_FAMILIES))
def test_greedy_tokens_match_transformers_generate(family, tiny_hf_dir):
    path = tiny_hf_dir(family)
    ref_model = hf_model(path)
    model = load_model(str(path), "float32")
    prompt = [int(x) for x in np.random.RandomState(2).randint(3, model.config.vocab_size, size=9)]
    with torch.no_grad():
        out = ref_model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_STEPS, do_sample=False)
    expected = out[0, len(prompt):].tolist()
    with Engine(model, EngineConfig(max_batch=1, max_prefill_rows=1, aot=False, quick_compile=True)) as engine:
        got = engine.generate([(prompt, SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS))])[0]
    assert got.token_ids == expected
    # These seeds never sample EOS, so all 16 steps are compared.
    assert len(got.token_ids) == GREEDY_STEPS and got.finish_reason == "length"


def test_sharded_safetensors_load_the_same(tiny_hf_dir):
    whole = load_model(str(tiny_hf_dir("llama3")), "float32")
    sharded_dir = tiny_hf_dir("llama3", max_shard_size="40KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = load_model(str(sharded_dir), "float32")
    same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), whole.params, sharded.params)
    assert all(jax.tree.leaves(same))
