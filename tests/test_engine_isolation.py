"""No request can hurt another: a failure in one request's own processing (its output handler,
its detokenizing) ends that request alone while the engine serves the others exactly as
before; a failure of the engine itself ends every request with an error, after which the
engine refuses new requests as stopped (503 over HTTP) and tells its owner (`on_fatal`), so
a server exits non-zero for its supervisor to restart it."""

from __future__ import annotations

import threading

import httpx
import pytest

from jfire import faults
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig, EngineStopped
from jfire.errors import JfireError
from jfire.sampling import SamplingParams
from serve.app import ServerState, create_app

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3], [7, 7, 21], [30, 2, 11, 40, 8]]


@pytest.fixture(scope="module")
def model(tiny_hf_dir):
    return load_model(str(tiny_hf_dir("llama2")), "float32")


def config():
    return EngineConfig(max_batch=4, max_prefill_rows=4, aot=False, max_model_len=64, kv_cache_bytes=8 << 20,
                        quick_compile=True)


@pytest.fixture(scope="module")
def alone(model):
    with Engine(model, config()) as engine:
        return [engine.generate([(p, GREEDY)])[0].token_ids for p in PROMPTS]


def test_a_failing_output_handler_cancels_only_its_request(model, alone):
    with Engine(model, config()) as engine:
        calls = []

        def broken(out):
            calls.append(out)
            raise RuntimeError("the client's handler broke")

        engine.submit(PROMPTS[0], GREEDY, on_output=broken)
        good = [engine.submit(p, GREEDY) for p in PROMPTS]
        assert [h.result().token_ids for h in good] == alone
        assert len(calls) < GREEDY.max_tokens  # cancelled after its handler failed, not run to the end
        assert engine.error is None
        assert engine.generate([(PROMPTS[1], GREEDY)])[0].token_ids == alone[1]
        stats = engine.stats()
        assert stats["running"] == 0 and stats["pages_used"] == 0


def test_a_request_whose_processing_fails_ends_alone(model, alone, monkeypatch):
    """A fault injected into one request's output processing (as a detokenizer or stop-string
    bug would raise): that request ends with an error naming it, its pages are freed, and the
    requests batched with it produce exactly what they produce alone."""
    def failing(seq, token):
        if seq.request_id == "victim" and seq.num_generated >= 3:
            raise ValueError("injected fault")

    monkeypatch.setattr(faults, "before_output", failing)
    with Engine(model, config()) as engine:
        victim = engine.submit(PROMPTS[2], GREEDY, request_id="victim")
        others = [engine.submit(p, GREEDY) for p in PROMPTS[:2]]
        assert [h.result().token_ids for h in others] == alone[:2]
        with pytest.raises(JfireError, match="request failed: ValueError: injected fault"):
            victim.result()
        assert engine.error is None and engine.health()[0] == 200
        stats = engine.stats()
        assert stats["running"] == 0 and stats["pages_used"] == 0


def test_an_engine_failure_ends_everything_and_stops_the_engine(model, monkeypatch):
    fatal = threading.Event()
    with Engine(model, config()) as engine:
        engine.on_fatal = lambda e: fatal.set()
        engine.generate([(PROMPTS[0], SamplingParams(max_tokens=2))])  # compiles and runs normally

        def device_failure(*args, **kwargs):
            raise RuntimeError("injected device failure")

        monkeypatch.setattr(engine.programs, "decode", lambda rows: device_failure)
        handles = [engine.submit(p, GREEDY) for p in PROMPTS]
        for h in handles:
            with pytest.raises(JfireError, match="engine failure: injected device failure"):
                h.result()
        assert fatal.wait(10)
        status, body = engine.health()
        assert status == 503 and body["status"] == "error"
        with pytest.raises(EngineStopped, match="stopped after an error"):
            engine.submit(PROMPTS[0], GREEDY)

        # Over HTTP the stopped engine is the server's fault, not the client's: 503, never 400.
        async def post():
            transport = httpx.ASGITransport(app=create_app(ServerState(engine=engine, model_name="m")))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                r = await client.post("/v1/completions", json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 2})
                return r, await client.get("/health")

        import asyncio

        r, health = asyncio.run(post())
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped", r.text
        assert health.status_code == 503
