"""The serving engine on meshes: the default model on pp=2,tp=3 (9 heads, 3 KV heads,
30 layers) gives the same greedy tokens as one device, and so does a tiny Qwen3 (q/k norms)
on pp=2,tp=2, through chunked prefill and batched decode."""

from __future__ import annotations


from jfire import mesh as meshes
from jfire import sharding
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def generate(model, prompts):
    config = EngineConfig(max_batch=4, max_prefill_rows=4, prefill_budget=16, max_model_len=128, num_pages=96,
                          aot=False)
    with Engine(model, config) as engine:
        return [c.token_ids for c in engine.generate([(p, GREEDY) for p in prompts])]


def test_default_model_on_pp2_tp3_equals_one_device(default_checkpoint):
    single = load_model("default", "float32")
    prompts = [single.tokenizer.encode(p) for p in ("The capital of France is", "A short poem about the sea:",
                                                    "def fibonacci(n):")]
    want = generate(single, prompts)
    sharded = load_model("default", "float32", mesh_spec=meshes.resolve("pp=2,tp=3"))
    assert len(sharding.addressable_bytes(sharded.params)) == 6
    assert generate(sharded, prompts) == want


def test_tiny_qwen3_on_pp2_tp2(tiny_hf_dir):
    path = str(tiny_hf_dir("qwen3"))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [30, 31], [40, 41, 42, 43]]
    want = generate(load_model(path, "float32"), prompts)
    spec = meshes.resolve("pp=2,tp=2")  # the tiny Qwen3 has 2 layers, 4 heads, 2 KV heads
    assert generate(load_model(path, "float32", mesh_spec=spec), prompts) == want
