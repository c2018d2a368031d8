"""Speculative decoding on a pp=2 x tp=2 mesh: the verify program runs through the pipeline's
stages and the tensor-parallel layers; the greedy tokens with drafts (accepted and refused)
equal one device's without, and every request's tokens and logprobs equal the mesh's own
without drafts."""

from __future__ import annotations

from jfire import mesh as meshes
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.speculative.drafters import NgramDrafter
from tests.test_speculative import Oracle, Silent, requests_for, run, same

CONFIG = dict(max_batch=4, max_prefill_rows=4, prefill_budget=16, page_size=4, max_model_len=96, num_pages=96,
              aot=False, speculative="ngram", num_draft_tokens=3)


def test_tiny_qwen3_on_pp2_tp2_with_drafts_equals_one_device(tiny_hf_dir):
    path = str(tiny_hf_dir("qwen3"))  # 2 layers, 4 heads, 2 KV heads
    model = load_model(path, "float32")
    requests = requests_for(model.config.vocab_size)
    with Engine(model, EngineConfig(**CONFIG)) as engine:
        one_device = run(engine, Silent(), requests)
    sharded = load_model(path, "float32", mesh_spec=meshes.resolve("pp=2,tp=2"))
    with Engine(sharded, EngineConfig(**CONFIG)) as engine:
        want = run(engine, Silent(), requests)
        greedy = [i for i, (_, sp) in enumerate(requests) if sp.temperature == 0]
        assert [want[i].token_ids for i in greedy] == [one_device[i].token_ids for i in greedy]
        answers = {(tuple(p), sp): c.token_ids for (p, sp), c in zip(requests, want)}
        same(run(engine, Oracle(answers, wrong=3), requests), want, "mesh")
        assert engine.stats()["spec_accepted_tokens"] > 0
        assert engine.stats()["spec_accepted_tokens"] < engine.stats()["spec_draft_tokens"]
        same(run(engine, NgramDrafter(), requests), want, "mesh")
