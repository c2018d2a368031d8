"""Images on a pp=2 x tp=2 mesh: the tiny random Llama 4 with its vision tower
(tests/vision/test_image_prompts.py). The encoder runs whole on one device of the mesh's
process, its rows enter the prefill programs replicated, and the text model runs sharded
through the pipeline's stages; the greedy tokens equal one device's."""

from __future__ import annotations

from jfire import mesh as meshes
from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from tests.vision.test_image_engine import GREEDY, request_images
from tests.vision.test_image_prompts import llama4_case  # noqa: F401  (fixture)

CONFIG = dict(max_batch=2, max_prefill_rows=2, prefill_budget=16, page_size=8, max_model_len=96, num_pages=32,
              aot=False)


def test_images_on_pp2_tp2_equal_one_device(llama4_case):  # noqa: F811
    images = request_images(llama4_case, (1, 2))
    ids = llama4_case.vision.expand_prompt(llama4_case.template_ids, [i.pixels for i in images])
    path = str(llama4_case.path)
    tokens = []
    for mesh_spec in (None, meshes.resolve("pp=2,tp=2")):
        model = load_model(path, "float32", mesh_spec=mesh_spec)
        with Engine(model, EngineConfig(**CONFIG)) as engine:
            assert engine.vision is not None
            tokens.append(engine.submit(ids, GREEDY, images=images).result().token_ids)
    assert tokens[1] == tokens[0]
