"""A page pool per kind of layer, through the engine: a tiny Mistral (every layer a sliding
window of 8) and a tiny Llama 4 (chunks of 8 beside global NoPE layers) run prompts several
windows long in a KV cache too small to hold one row's whole context in one pool. The
windowed pool's pages go back as they leave the window, so the requests run, and they give
transformers' greedy tokens and the log-softmax of transformers' logits at every prompt
position; the windowed pool's pages in use never exceed what its rows' windows need; a
repeated prompt is served from the windowed pool's cached blocks; one pool keeping every
page, in the same bytes, refuses the same requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jfire import faults
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.errors import RequestError
from jfire.kv_cache import page_bytes
from jfire.sampling import SamplingParams
from tests.tiny_models import build_tiny_hf_model

PAGE, BUDGET, ROWS = 4, 8, 2
PROMPT, NEW = 40, 24  # 64 positions: 16 pages of 4, five windows of 8
# (family, the windowed group, the cache's bytes in pages of every layer): too few for one
# row's whole context (16 pages) in one pool.
CASES = [("mistral", "sliding", 10), ("llama4", "chunked", 15)]


def limits(model, pages_of_every_layer: int, pool_per_kind: bool = True) -> EngineConfig:
    return EngineConfig(page_size=PAGE, kv_cache_bytes=pages_of_every_layer * page_bytes(model.config, PAGE, np.float32),
                        max_batch=ROWS, prefill_budget=BUDGET, max_prefill_rows=ROWS, aot=False, max_model_len=96,
                        quick_compile=True, pool_per_kind=pool_per_kind)


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(x) for x in rng.integers(3, vocab, size=PROMPT - i)] for i in range(ROWS)]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, tiny_hf_dir):
    family, group, num_pages = request.param
    model = load_model(str(tiny_hf_dir(family)), "float32")
    return family, group, num_pages, model, build_tiny_hf_model(family)


def test_windowed_pages_go_back_and_tokens_equal_transformers(case):
    family, group, num_pages, model, hf = case
    ids = prompts(model.config.vocab_size)
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=5, prompt_logprobs=True)
    peak = {"used": 0}
    with Engine(model, limits(model, num_pages)) as engine:
        assert not engine.pools.shared and all(gp.pool.num_pages >= 16 for gp in engine.pools.pools
                                                if not gp.group.windowed)
        pool = next(gp for gp in engine.pools.pools if gp.group.name == group)
        bound = ROWS * pool.group.pages_per_row(10**6, PAGE, BUDGET)

        def record(_seqs):  # on the engine thread, before each decode step
            peak["used"] = max(peak["used"], pool.pool.stats().used)

        faults.before_decode = record
        try:
            handles = [engine.submit(p, sampling) for p in ids]
            outputs = [list(h) for h in handles]
        finally:
            faults.before_decode = None
        stats = engine.stats()
    assert 0 < peak["used"] <= bound
    assert stats["kv_groups"][group]["used"] == 0 and stats["pages_used"] == 0
    for prompt, outs in zip(ids, outputs):
        generated = [t for o in outs for t in o.token_ids]
        with torch.no_grad():
            reference = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                    min_new_tokens=NEW, pad_token_id=0)[0, len(prompt):].tolist()
            logits = hf(torch.tensor([prompt])).logits[0].double()
        assert generated == reference
        expected = torch.log_softmax(logits, -1).numpy()
        entries = outs[0].prompt_logprobs
        assert len(entries) == len(prompt) - 1
        for pos, (logprob, top) in enumerate(entries):  # entry of prompt token pos + 1
            np.testing.assert_allclose(logprob, expected[pos, prompt[pos + 1]], atol=2e-4)
            top_ids = [i for i, _ in top]
            np.testing.assert_allclose([lp for _, lp in top], expected[pos, top_ids], atol=2e-4)


def test_a_repeated_prompt_is_served_from_the_windowed_pools_cached_blocks(case):
    family, group, num_pages, model, hf = case
    prompt = prompts(model.config.vocab_size)[0]
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with Engine(model, limits(model, num_pages)) as engine:
        first, second = ([o for o in engine.submit(prompt, sampling)] for _ in range(2))
    with torch.no_grad():
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, min_new_tokens=4,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert [t for o in first for t in o.token_ids] == [t for o in second for t in o.token_ids] == reference
    # Every whole block but the one holding the last prompt token: the full groups hold all of
    # them, the windowed pool the blocks the window still needs.
    assert first[-1].prefix_hit_tokens == 0 and second[-1].prefix_hit_tokens == (len(prompt) - 1) // PAGE * PAGE


def test_one_pool_keeping_every_page_refuses_what_the_windowed_pool_runs(case):
    family, group, num_pages, model, _ = case
    engine = Engine(model, limits(model, num_pages, pool_per_kind=False))
    try:
        assert engine.pools.shared
        with pytest.raises(RequestError, match="KV pages"):
            engine.checks.check(prompts(model.config.vocab_size)[0], SamplingParams(max_tokens=NEW))
    finally:
        engine.shutdown()
