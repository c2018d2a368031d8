"""The KV connector protocol (jfire.kv_connector), with the in-process pair written against it
alone: a prompt run by a prefill-only engine, its KV carried through host memory into a
decode-only engine, decodes to the same tokens as the colocated engine; and the engine's
parts stay parts (checked by walking the code)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from jfire.checkpoint.load import load_model
from jfire.disagg.in_process import HostKVStore, InProcessDecode, InProcessPrefill
from jfire.engine import Engine, EngineConfig
from jfire.errors import JfireError
from jfire.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
LIMITS = dict(page_size=4, max_batch=4, prefill_budget=32, max_prefill_rows=4, max_model_len=96, aot=False,
              quick_compile=True, num_pages=128)


@pytest.fixture(scope="module")
def tiny_model(tiny_hf_dir):
    return load_model(str(tiny_hf_dir("llama2")), "float32")


def requests_for(model, count=6):
    rng = np.random.default_rng(11)
    out = []
    for i in range(count):
        ids = [int(x) for x in rng.integers(3, model.config.vocab_size, size=int(rng.integers(3, 40)))]
        # Greedy, and sampled with a fixed seed: both sides draw from the same seed.
        sampling = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=100 + i, max_tokens=12, ignore_eos=True,
                                  logprobs=2 if i == 3 else None)
        out.append((ids, sampling))
    return out


def test_kv_carried_by_the_in_process_connector_decodes_as_colocated(tiny_model):
    requests = requests_for(tiny_model)
    with Engine(tiny_model, EngineConfig(**LIMITS)) as colocated:
        expected = [c.token_ids for c in colocated.generate(requests)]
    store = HostKVStore()
    decode_side = InProcessDecode(store)
    with Engine(tiny_model, EngineConfig(**LIMITS), InProcessPrefill(store)) as prefill, \
            Engine(tiny_model, EngineConfig(**LIMITS), decode_side) as decode:
        firsts = [prefill.submit(ids, sp, request_id=f"r{i}") for i, (ids, sp) in enumerate(requests)]
        handles = []
        for i, ((ids, sp), handle) in enumerate(zip(requests, firsts)):
            out = list(handle)[-1]
            assert out.finish_reason == "prefilled" and len(out.token_ids) == 1
            kv = {"first_token": out.token_ids[0], "transfer": out.transfer,
                  "first_logprobs": (out.logprobs or [None])[0]}
            handles.append(decode.submit(ids, sp, request_id=f"r{i}", kv_params=kv))
        got = [h.result().token_ids for h in handles]
        assert got == expected
        assert decode_side.loaded == len(requests) and len(store) == 0
        # Every page is back in both pools once the requests are done.
        assert prefill.stats()["pages_used"] == 0 and decode.stats()["pages_used"] == 0
        # Each side refuses what it cannot take, before queueing anything.
        with pytest.raises(JfireError, match="request id"):
            prefill.submit(requests[0][0], requests[0][1])
        with pytest.raises(JfireError, match="prefilled requests"):
            decode.submit(requests[0][0], requests[0][1], request_id="plain")


# -- the engine as parts, checked by walking the code ------------------------------------------------

SOURCES = sorted([*ROOT.glob("jfire/**/*.py"), *ROOT.glob("serve/**/*.py")])
# Each part's own files may read its own underscore attributes.
PARTS = {"engine": "jfire/engine.py", "runner": "jfire/runner.py", "connector": "jfire/kv_connector.py"}
PART_OBJECTS = {"engine", "runner", "connector", "self.engine", "self.runner", "engine.runner", "engine.connector",
                "self.connector", "state.engine"}


def test_the_engine_module_stays_small_and_nothing_subclasses_engine():
    assert len((ROOT / "jfire/engine.py").read_text().splitlines()) <= 450
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert not any(b == "Engine" or b.endswith(".Engine") for b in bases), (path, node.name)


def test_no_module_reads_another_parts_private_state():
    """`engine._x`, `runner._x`, `connector._x` (and through `self.engine` and the like) only
    inside the part's own file."""
    found = []
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = ast.unparse(node.value)
                if owner in PART_OBJECTS and rel not in PARTS.values():
                    found.append(f"{rel}:{node.lineno}: {owner}.{node.attr}")
    assert not found, found
