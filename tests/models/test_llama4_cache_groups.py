"""Llama 4's two cache groups: the NoPE layers' keys and values in `k`/`v` (global attention),
the chunked RoPE layers' in `k_chunked`/`v_chunked`, each array holding only its group's layers
and read through its group's own columns of the page table, the group being scanned data (the
scan step stays one period of MLP kinds: here dense and MoE, as Maverick's). A tiny Llama 4
with RoPE on three layers of four gives transformers' logits at every position of a prompt
several chunks long, prefilled in two pieces, with each group's pages laid out differently in
its own pool."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jfire.checkpoint.load import load_model
from jfire.models.family import forward, group_table, init_cache
from tests import greedy_programs
from tests.tiny_models import COMMON, LLAMA4_TEXT

CHUNK, PAGE, PROMPT, SPLIT = 16, 4, 56, 23  # 3.5 chunks; the first piece ends mid-chunk, mid-page
LAYERS = 8
NO_ROPE = [1, 1, 1, 0, 1, 1, 1, 0]  # transformers' flag: 1 = RoPE (chunked), 0 = NoPE (global)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(jfire model, transformers model) of a saved tiny Llama 4: MoE every second layer, NoPE
    every fourth, chunks of 16."""
    text = {**COMMON, **LLAMA4_TEXT, "num_hidden_layers": LAYERS, "no_rope_layers": NO_ROPE,
            "attention_chunk_size": CHUNK}
    config = transformers.Llama4TextConfig(**text)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(3)
    model = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("llama4_groups")
    model.save_pretrained(path)
    return load_model(str(path), "float32"), model


def test_two_groups_arrays_of_their_layers(tiny):
    cfg = tiny[0].config
    assert [(g.name, g.chunk) for g in cfg.cache_groups()] == [("global", None), ("chunked", CHUNK)]
    (segment,) = cfg.segments()
    assert (segment.period, segment.steps) == (("dense", "moe"), 4)
    cache = init_cache(cfg, 1, 64, jnp.float32, page_size=PAGE)
    nope, rope = NO_ROPE.count(0), NO_ROPE.count(1)
    assert {n: a.shape[0] for n, a in cache.items() if n != "page_table"} == {
        "k": nope, "v": nope, "k_chunked": rope, "v_chunked": rope}
    assert {c.name: c.group for c in cfg.cache_specs()} == {
        "k": "global", "v": "global", "k_chunked": "chunked", "v_chunked": "chunked"}
    assert cache["page_table"].shape == (1, 2 * 64 // PAGE)


def test_prefill_in_two_pieces_matches_transformers_at_every_position(tiny):
    model, ref = tiny
    cfg, params = model.config, model.params
    prompt = np.random.RandomState(4).randint(3, cfg.vocab_size, size=PROMPT)
    with torch.no_grad():
        want = ref(torch.tensor(prompt[None])).logits[0].numpy()

    # Each group's own pool and page order, as the engine's pools per group make them: the
    # global pool holds every page of the row, in an order of its own; the chunked pool only
    # three chunks' worth, chunk c on the pages chunk c - 3 used (no query of a later piece sees
    # them again). A layer writing or reading through the other group's table or arrays gets
    # other positions' keys, or drops them past the smaller pool.
    rng = np.random.RandomState(5)
    width, per_chunk = 64 // PAGE, CHUNK // PAGE
    recycled = rng.permutation(3 * per_chunk)[[(p // per_chunk) % 3 * per_chunk + p % per_chunk for p in range(width)]]
    table = np.concatenate([rng.permutation(width), recycled])[None].astype(np.int32)
    assert np.array_equal(group_table(cfg, table, "chunked")[0], recycled)
    pool = {"global": width, "chunked": 3 * per_chunk}
    cache = {c.name: jnp.zeros(c.shape(pool[c.group], PAGE), jnp.float32) for c in cfg.cache_specs()}
    cache["page_table"] = jnp.asarray(table)

    run = greedy_programs.quick(forward, static_argnums=1)
    got = []
    for start, stop in ((0, SPLIT), (SPLIT, PROMPT)):
        logits, cache = run(params, cfg, jnp.asarray(prompt[None, start:stop]), jnp.arange(start, stop)[None], cache)
        got.append(np.asarray(logits[0]))
    got = np.concatenate(got)
    for t in range(PROMPT):
        err = np.linalg.norm(got[t] - want[t]) / np.linalg.norm(want[t])
        assert err < 1e-4, f"position {t}: relative error {err:.2e}"
