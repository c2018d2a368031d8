"""A deliberately tiny page pool: requests are preempted and recomputed, and still every
greedy output equals the same request run alone with room to spare."""

from __future__ import annotations

import numpy as np
import pytest

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.errors import QueueFull
from jfire.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny_model(tiny_hf_dir):
    return load_model(str(tiny_hf_dir("llama2")), "float32")


def requests_for(model, count=16):
    rng = np.random.default_rng(7)
    out = []
    for i in range(count):
        ids = [int(x) for x in rng.integers(3, model.config.vocab_size, size=int(rng.integers(4, 30)))]
        sampling = SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=24, ignore_eos=True)
        out.append((ids, sampling))
    return out


def test_preempted_requests_equal_running_alone(tiny_model):
    requests = requests_for(tiny_model)
    # The same limits but the pool (the reference one row at a time, without prefix caching).
    limits = dict(page_size=4, max_batch=16, prefill_budget=32, max_prefill_rows=4, max_model_len=128, aot=False,
                  quick_compile=True)
    with Engine(tiny_model, EngineConfig(num_pages=512, prefix_caching=False, **limits)) as engine:
        alone = [engine.generate([r])[0].token_ids for r in requests]
    # 14 pages of 4 slots: two or three sequences fit at once, sixteen are asked for.
    with Engine(tiny_model, EngineConfig(num_pages=14, **limits)) as engine:
        together = [c.token_ids for c in engine.generate(requests)]
        stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["pages_used"] == 0
    assert together == alone


def test_a_request_larger_than_the_pool_is_refused(tiny_model):
    config = EngineConfig(page_size=4, num_pages=4, max_batch=2, aot=False, max_model_len=128)
    with Engine(tiny_model, config) as engine:
        with pytest.raises(Exception, match="KV pages"):
            engine.submit(list(range(3, 20)), SamplingParams(max_tokens=8))


def test_full_waiting_queue_is_refused_not_lost(tiny_model):
    config = EngineConfig(page_size=4, num_pages=64, max_batch=1, max_waiting=3, aot=False, max_model_len=128)
    engine = Engine(tiny_model, config)  # not started: nothing drains the queue
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    handles = [engine.submit([5, 6, 7], sampling) for _ in range(3)]
    with pytest.raises(QueueFull, match="retry"):
        engine.submit([5, 6, 7], sampling)
    engine.start()
    try:
        assert all(len(h.result().token_ids) == 4 for h in handles)
    finally:
        engine.shutdown()


def test_a_one_row_engine_holds_one_full_context(tiny_model):
    """Sized by bytes, a one-row engine (`jfire generate`) takes pages for one full context,
    which is all its one row can hold; a pool given in pages, or with more rows, is as given."""
    limits = dict(page_size=4, max_model_len=128, aot=False, kv_cache_bytes=1 << 20)  # over a thousand pages
    one_row = Engine(tiny_model, EngineConfig(max_batch=1, **limits))
    assert one_row.pool.num_pages == 128 // 4
    sampling = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    with one_row:  # and a request filling the context runs to its end in it
        assert len(one_row.generate([(list(range(3, 30)), sampling)])[0].token_ids) == 100
    assert Engine(tiny_model, EngineConfig(max_batch=1, num_pages=64, **limits)).pool.num_pages == 64
    assert Engine(tiny_model, EngineConfig(max_batch=2, **limits)).pool.num_pages > 128 // 4
