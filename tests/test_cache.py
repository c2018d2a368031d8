"""Cached decoding equals uncached recomputation.

A prompt goes through the prefill program (padded to a bucket, position -1 for padding),
then tokens go one at a time through the decode program; at every step the logits must
equal those of `forward` run on the whole sequence so far from scratch with a fresh cache.
The cached side runs on a paged pool whose pages are scattered, shared between rows and
pre-filled with garbage, so a slot read before it is written shows in the logits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfire.models.blocks import RopeScaling
from jfire.models.family import forward, init_cache
from jfire.models.llama import LlamaConfig
from jfire.models.params import get_path, init_params, set_path
from tests import greedy_programs

TOL = 1e-5  # relative error, float32

BASE = LlamaConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)

CONFIGS = {
    "plain": BASE,
    "qk_norm_qkv_bias": dataclasses.replace(
        BASE, architecture="Qwen3ForCausalLM", qk_norm=True, qkv_bias=True, head_dim=32),
    "sliding_window": dataclasses.replace(BASE, architecture="MistralForCausalLM", sliding_window=5),
    "tied_llama3_rope_o_bias_mqa": dataclasses.replace(
        BASE, tie_word_embeddings=True, o_bias=True, num_kv_heads=1, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16)),
}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.lru_cache(maxsize=None)
def make_params(name: str) -> dict:
    cfg = CONFIGS[name]
    specs = cfg.param_specs()
    # One jitted call, not one small compile per parameter; an rbg key because threefry's
    # normal sampler takes seconds to compile on the CPU. Wide weights give peaked logits.
    key = jax.random.key(0, impl="unsafe_rbg")
    params = jax.jit(lambda key: init_params(specs, key, jnp.float32, scale=0.2))(key)
    # Norm weights and biases start at 1 / 0: perturb them so they matter.
    rng = np.random.RandomState(1)
    for s in specs:
        if s.init != "normal":
            set_path(params, s.name, get_path(params, s.name) + jnp.asarray(0.1 * rng.standard_normal(s.shape), jnp.float32))
    return params


_forward = greedy_programs.quick(forward, static_argnames=("cfg",))


def uncached_logits(params, cfg, seq) -> np.ndarray:
    """The reference: logits [t, v] of the whole sequence from scratch, a fresh cache exactly its length."""
    n = len(seq)
    logits, _ = _forward(params, cfg, jnp.asarray([seq], jnp.int32), jnp.arange(n, dtype=jnp.int32)[None],
                         init_cache(cfg, 1, n, jnp.float32))
    return np.asarray(logits[0])


def uncached_last_logits(params, cfg, seq) -> np.ndarray:
    return uncached_logits(params, cfg, seq)[-1]


def scrambled_pool(cfg, rows: int, pages_per_row: int, page_size: int, rng):
    """A page pool shared by `rows` rows whose pages are scattered in a random order, with
    spare pages, all filled with large finite garbage (as pages freed by earlier requests are):
    a slot read before it is written, or another row's page, would show in the logits."""
    num_pages = rows * pages_per_row + 3
    table = rng.permutation(num_pages)[: rows * pages_per_row].reshape(rows, pages_per_row)
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    pages = {kv: jnp.asarray(10 * rng.standard_normal(shape), jnp.float32) for kv in ("k", "v")}
    return pages, jnp.asarray(table, jnp.int32)


def run_cached(params, cfg, prompts, bucket, pages_per_row, steps, rng, *, page_size=4, attention="reference"):
    """Prefill a batch of prompts (ragged, padded to `bucket`), then greedy-decode `steps` tokens.

    Returns per row the list of (sequence so far, logits for its next token) at every step.
    Padding slots get random token ids, not zeros: if padding leaked into the cache, the
    garbage would show in the logits.
    """
    b = len(prompts)
    assert max(len(p) for p in prompts) + steps <= pages_per_row * page_size
    tokens = rng.randint(0, cfg.vocab_size, size=(b, bucket)).astype(np.int32)
    positions = np.full((b, bucket), -1, np.int32)
    for r, p in enumerate(prompts):
        tokens[r, : len(p)] = p
        positions[r, : len(p)] = np.arange(len(p))
    last = jnp.asarray([len(p) - 1 for p in prompts], jnp.int32)
    pages, table = scrambled_pool(cfg, b, pages_per_row, page_size, rng)
    ids, logits, pages = greedy_programs.prefill(
        params, pages, jnp.asarray(tokens), jnp.asarray(positions), table, last, cfg=cfg, attention=attention)
    seqs = [list(p) for p in prompts]
    record = [[] for _ in prompts]
    for step in range(steps + 1):
        logits = np.asarray(logits)
        ids_host = np.asarray(ids)
        for r in range(b):
            record[r].append((list(seqs[r]), logits[r]))
            # The program's greedy choice is the argmax of the logits it returned.
            assert int(ids_host[r]) == int(np.argmax(logits[r]))
            seqs[r].append(int(ids_host[r]))
        if step == steps:
            break
        positions = jnp.asarray([len(s) - 1 for s in seqs], jnp.int32)
        ids, logits, pages = greedy_programs.decode(params, pages, ids, positions, table, cfg=cfg,
                                                    attention=attention)
    return record


def check_against_uncached(params, cfg, record, *, every_prefix=False):
    """Each step's cached logits against uncached ones. every_prefix: run `forward` afresh on
    each prefix (one compile per length); otherwise once on the final sequence and read each
    step's position, which is the same reference because `forward` is causal (its logits at
    every position match transformers in tests/models/test_hf_parity.py)."""
    final = record[-1][0]
    full = None if every_prefix else uncached_logits(params, cfg, final)
    for step, (seq, logits) in enumerate(record):
        assert seq == final[: len(seq)]
        ref = uncached_last_logits(params, cfg, seq) if every_prefix else full[len(seq) - 1]
        err = rel_err(logits, ref)
        assert err < TOL, f"step {step} (sequence length {len(seq)}): relative error {err:.2e}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_matches_uncached(name):
    cfg, params = CONFIGS[name], make_params(name)
    rng = np.random.RandomState(1)
    prompt = rng.randint(0, cfg.vocab_size, size=9).tolist()
    # Prompt 9 in a bucket of 16, 7 decode steps: 16 tokens over 4 pages, past a window of 5.
    record = run_cached(params, cfg, [prompt], bucket=16, pages_per_row=4, steps=7, rng=rng)
    check_against_uncached(params, cfg, record[0], every_prefix=name == "sliding_window")


def test_pallas_kernels_match_uncached():
    """The same check with the Pallas prefill and decode kernels (interpret mode on the CPU): a
    ragged batch whose second row is shorter than the window, the first row longer."""
    cfg, params = CONFIGS["sliding_window"], make_params("sliding_window")
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, cfg.vocab_size, size=n).tolist() for n in (6, 3)]
    record = run_cached(params, cfg, prompts, bucket=16, pages_per_row=4, steps=5, rng=rng,
                        attention="pallas-interpret")
    for r in range(len(prompts)):
        check_against_uncached(params, cfg, record[r])


def test_sliding_window_is_really_shorter_than_the_sequence():
    """The window case must exercise the window: without it the logits would differ."""
    cfg = CONFIGS["sliding_window"]
    params = make_params("sliding_window")
    seq = np.random.RandomState(1).randint(0, cfg.vocab_size, size=16).tolist()
    unwindowed = dataclasses.replace(cfg, sliding_window=None)
    assert rel_err(uncached_last_logits(params, unwindowed, seq), uncached_last_logits(params, cfg, seq)) > 1e-2


def test_padding_in_a_large_bucket_does_not_disturb_the_cache():
    """A 3-token prompt in a 32-token bucket: 29 padding slots with garbage ids must write nothing."""
    cfg, params = CONFIGS["plain"], make_params("plain")
    rng = np.random.RandomState(2)
    prompt = rng.randint(0, cfg.vocab_size, size=3).tolist()
    record = run_cached(params, cfg, [prompt], bucket=32, pages_per_row=8, steps=6, rng=rng)
    check_against_uncached(params, cfg, record[0])


def test_padding_with_sliding_window_and_ragged_batch():
    """Two rows of different lengths in one padded batch, their pages interleaved in one pool:
    each row equals its own uncached run."""
    for name in ("sliding_window", "qk_norm_qkv_bias"):
        cfg, params = CONFIGS[name], make_params(name)
        rng = np.random.RandomState(3)
        prompts = [rng.randint(0, cfg.vocab_size, size=n).tolist() for n in (11, 4)]
        record = run_cached(params, cfg, prompts, bucket=16, pages_per_row=4, steps=5, rng=rng)
        for r in range(len(prompts)):
            check_against_uncached(params, cfg, record[r])


def test_chunked_prefill_matches_uncached():
    """A prompt prefilled in two chunks (positions 0..7, then 8..12 padded to 8) then decoded."""
    cfg, params = CONFIGS["sliding_window"], make_params("sliding_window")
    rng = np.random.RandomState(4)
    prompt = rng.randint(0, cfg.vocab_size, size=13).tolist()
    pages, table = scrambled_pool(cfg, 1, 8, 4, rng)
    chunk1 = jnp.asarray([prompt[:8]], jnp.int32)
    _, logits, pages = greedy_programs.prefill(params, pages, chunk1, jnp.arange(8, dtype=jnp.int32)[None], table,
                                               jnp.asarray([7]), cfg=cfg)
    assert rel_err(logits[0], uncached_last_logits(params, cfg, prompt[:8])) < TOL
    tokens = rng.randint(0, cfg.vocab_size, size=(1, 8)).astype(np.int32)
    tokens[0, :5] = prompt[8:]
    positions = np.full((1, 8), -1, np.int32)
    positions[0, :5] = np.arange(8, 13)
    ids, logits, pages = greedy_programs.prefill(params, pages, jnp.asarray(tokens), jnp.asarray(positions), table,
                                                 jnp.asarray([4]), cfg=cfg)
    seq = list(prompt)
    record = []
    for step in range(4):
        record.append((list(seq), np.asarray(logits[0])))
        seq.append(int(ids[0]))
        ids, logits, pages = greedy_programs.decode(params, pages, ids, jnp.asarray([len(seq) - 1], jnp.int32),
                                                    table, cfg=cfg)
    check_against_uncached(params, cfg, record)
