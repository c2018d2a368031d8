"""The continuous-batching engine against running each request alone, and its bookkeeping:
preemption, prefix caching, cancellation, no compilation after warm-up."""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
import pytest

from jfire import compile_cache
from jfire.checkpoint.load import load_model
from jfire.engine import Engine
from jfire.errors import JfireError
from jfire.sampling import SamplingParams
from tests.limits import serve_engine_config

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def quicksort(items):",
    "The three laws of robotics are",
    "Photosynthesis is the process by which",
    "My favourite recipe for pancakes needs",
    "In 1969, the first humans to walk on the moon",
    "A haiku about autumn leaves:",
    "The difference between a list and a tuple in Python is",
    "To be or not to be,",
    "The mitochondria is",
    "Here is a short poem about the ocean:",
    "The best way to learn a new language is",
    "SELECT name, age FROM users WHERE",
    "Water boils at 100 degrees Celsius because",
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def default_model(default_checkpoint):
    return load_model("default", "float32")


COMPILES: list[tuple[str, str]] = []  # (event, thread name) of every XLA compilation while the engine lives
PROGRAMS: list[str] = []  # the thread that compiled or loaded each of the engine's programs


def _record_compile(event, duration, **kw):
    if "backend_compile" in event:
        COMPILES.append((event, threading.current_thread().name))


@pytest.fixture(scope="module")
def engine(default_model):
    """Serving once its essential programs exist; the first tests run while the others compile
    (or load: an earlier process of the run may have stored them, jfire.compile_cache)."""
    engine = Engine(default_model, serve_engine_config())
    compile_one = engine.programs._compile

    def recorded(shape):
        PROGRAMS.append(threading.current_thread().name)
        return compile_one(shape)

    engine.programs._compile = recorded
    jax.monitoring.register_event_duration_secs_listener(_record_compile)
    try:
        with engine:
            yield engine
    finally:
        jax.monitoring.unregister_event_duration_listener(_record_compile)


def test_sixteen_prompts_batched_equal_each_alone(engine, default_model):
    tok = default_model.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [(tok.encode(p), greedy) for p in PROMPTS]
    together = engine.generate(requests)
    alone = [engine.generate([r])[0] for r in requests]
    for prompt, a, b in zip(PROMPTS, together, alone):
        assert a.token_ids == b.token_ids, prompt
        assert len(a.token_ids) == 12


def test_seeded_sampling_is_the_same_batched_or_alone(engine, default_model):
    tok = default_model.tokenizer
    requests = [(tok.encode(p), SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=i, max_tokens=12))
                for i, p in enumerate(PROMPTS[:6])]
    together = engine.generate(requests)
    alone = [engine.generate([r])[0] for r in requests]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


def _streams(engine, requests):
    """Every output of each request, submitted together: (ids, text, logprobs, finish reason)."""
    handles = [engine.submit(ids, sp) for ids, sp in requests]
    return [[(o.token_ids, o.text, o.logprobs, o.finish_reason) for o in h] for h in handles]


def test_running_ahead_gives_what_reading_each_step_gives(engine, default_model):
    """Decode steps dispatched before the previous step's ids are read (the default) against an
    engine that reads every step's ids before dispatching the next: the same outputs, with rows
    ending at different steps (by length, by a stop string), logprobs, seeded sampling with a
    penalty, and min_tokens (a mask: no running ahead until it is met)."""
    tok = default_model.tokenizer
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[" the"], min_tokens=4),
    ]
    requests = [(tok.encode(p), sp) for p, sp in zip(PROMPTS, params)]
    assert engine.wait_compiled(timeout=600)  # both runs pick from the same programs
    ahead_before = engine.stats()["run_ahead_steps"]
    ahead = _streams(engine, requests)
    ran_ahead = engine.stats()["run_ahead_steps"] - ahead_before
    engine.config = dataclasses.replace(engine.config, run_ahead=False)
    try:
        stepped = _streams(engine, requests)
        assert engine.stats()["run_ahead_steps"] == ahead_before + ran_ahead
    finally:
        engine.config = dataclasses.replace(engine.config, run_ahead=True)
    assert ran_ahead >= 10  # most of the 17 decode steps of the longest request
    # Running ahead keeps a finished row as padding where stepping runs a smaller batch program:
    # ids, texts and finish reasons equal, logprobs to float32 rounding between programs.
    assert [[(ids, text, end) for ids, text, _, end in s] for s in ahead] == \
           [[(ids, text, end) for ids, text, _, end in s] for s in stepped]
    for a, b in zip(ahead, stepped):
        for (_, _, lp_a, _), (_, _, lp_b, _) in zip(a, b):
            assert (lp_a is None) == (lp_b is None)
            if lp_a is not None:
                (value_a, top_a), = lp_a
                (value_b, top_b), = lp_b
                assert [i for i, _ in top_a] == [i for i, _ in top_b]
                assert np.allclose([value_a, *(v for _, v in top_a)], [value_b, *(v for _, v in top_b)],
                                   rtol=0, atol=1e-5)
    assert [s[-1][3] for s in ahead][:3] == ["length", "length", "length"]
    assert engine.stats()["pages_used"] == 0


def test_no_compilation_after_warm_up(engine, default_model):
    # Every program was compiled or loaded on the compiling threads (the tests above were
    # served while the last ones were), and nothing compiled on the engine thread serving
    # requests (the main thread's compilations are the engine's set-up: its page arrays).
    assert engine.wait_compiled(timeout=600)
    assert engine.programs.num_compiled == engine.programs.num_total == len(PROGRAMS)
    assert all(t.startswith("jfire-compile") for t in PROGRAMS), set(PROGRAMS)
    assert "jfire-engine" not in {thread for _, thread in COMPILES}, COMPILES
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        before = engine.programs.num_compiled
        rng = np.random.default_rng(0)
        # Varied prompt lengths (1..150 tokens, so several chunks) and batch sizes 1..16.
        for batch in (1, 3, 16, 7):
            requests = []
            for _ in range(batch):
                n = int(rng.integers(1, 150))
                ids = [int(x) for x in rng.integers(100, 40000, size=n)]
                requests.append((ids, SamplingParams(temperature=float(rng.choice([0.0, 0.8])),
                                                     max_tokens=int(rng.integers(1, 16)), seed=1)))
            engine.generate(requests)
        assert engine.programs.num_compiled == before
        assert [e for e in compiles] == []
        # The listener does see a compilation (it would pass vacuously were the event renamed).
        compile_cache._compiled_afresh(jax.jit(lambda x: x * 3.25 + 1).lower(np.float32(1)))
        assert compiles and all("backend_compile" in e for e in compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_prefix_cache_reuses_full_blocks(engine, default_model):
    tok = default_model.tokenizer
    system = ("You are a careful assistant. Answer in one short sentence, and never invent facts. "
              "If you do not know, say so plainly. ") * 2
    first, second = tok.encode(system + "What is the tallest mountain?"), tok.encode(system + "Who wrote Hamlet?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    hits_before = engine.stats()["prefix_hit_tokens"]
    a = engine.generate([(first, greedy)])[0]
    b_handle = engine.submit(second, greedy)
    b = b_handle.result()
    page = engine.config.page_size
    assert engine.stats()["prefix_hit_tokens"] - hits_before == (shared // page) * page
    assert shared // page >= 2
    # The reused blocks give exactly what recomputing them gives.
    config = serve_engine_config(prefix_caching=False, aot=False)
    with Engine(default_model, config) as plain:
        assert plain.generate([(second, greedy)])[0].token_ids == b.token_ids
        assert plain.generate([(first, greedy)])[0].token_ids == a.token_ids


def test_cancel_frees_pages_at_once(engine, default_model):
    ids = default_model.tokenizer.encode("Write a very long essay about the history of bread.")
    handle = engine.submit(ids, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    outputs = iter(handle)
    next(outputs)  # generation is under way
    assert engine.stats()["pages_used"] > 0
    handle.cancel()
    rest = list(outputs)
    assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
    # The engine publishes its stats before it delivers a step's outputs: whoever sees the
    # request end sees its pages freed, with no waiting.
    assert engine.stats()["pages_used"] == 0
    assert engine.stats()["running"] == 0


def test_requests_that_cannot_run_are_refused_up_front(engine):
    context = engine.max_model_len
    with pytest.raises(JfireError, match="context"):
        engine.submit(list(range(10, 10 + context + 40)), SamplingParams(max_tokens=4))
    with pytest.raises(JfireError, match="max_tokens"):
        engine.submit([10, 11], SamplingParams(max_tokens=context - 1))
    with pytest.raises(JfireError, match="vocabulary"):
        engine.submit([10, 10**6], SamplingParams(max_tokens=4))
    with pytest.raises(JfireError, match="empty"):
        engine.submit([], SamplingParams(max_tokens=4))
