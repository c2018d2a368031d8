"""Prompts with images through the engine (jfire.vision.encoder): the tiny random Llama 4 and
Kimi K2.5 of tests/vision/test_image_prompts.py, loaded by `load_model` and served by an
`Engine`, against transformers' `generate` given the same pixel values.

- Greedy tokens equal transformers', with prefill chunks that split the images' rows.
- The same images again: the encoder's cache serves them and the prefix cache holds the whole
  prompt's full pages (the tokens the same); another image of the same size, the same
  placeholder ids: no page past the first image is reused, and the encoder runs for it.
- Requests with images at once, in one batch, equal each alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jfire.checkpoint.load import load_model
from jfire.engine import Engine, EngineConfig
from jfire.errors import RequestError
from jfire.sampling import SamplingParams
from jfire.vision.encoder import RequestImage
from jfire.vision.images import content_hash
from tests.vision.test_image_prompts import GREEDY_STEPS, Case, kimi_case, llama4_case, random_image  # noqa: F401

PAGE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True)


def request_images(mm: Case, seeds: tuple[int, int]) -> list[RequestImage]:
    """The model's two image sizes, drawn with `seeds`: (hash, pixels) as a server makes them."""
    sizes = [(60, 100), (40, 30)] if mm.vision.family == "llama4" else [(84, 140), (50, 60)]
    out = []
    for (h, w), seed in zip(sizes, seeds):
        image = random_image(h, w, seed=seed)
        out.append(RequestImage(content_hash(image), mm.vision.preprocess(image)))
    return out


def transformers_greedy(mm: Case, ids: list[int], images: list[RequestImage]) -> list[int]:
    inputs = {"pixel_values": torch.from_numpy(np.concatenate([i.pixels.pixel_values for i in images]))}
    if "image_grid_thw" in mm.hf_image_inputs:
        inputs["image_grid_thw"] = torch.tensor([i.pixels.grid for i in images])
    with torch.no_grad():
        out = mm.hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=GREEDY_STEPS,
            do_sample=False,
            **inputs,
        )
    return out[0, len(ids) :].tolist()


def run(engine, ids, images):
    """(token ids, prefix hit tokens) of one request."""
    tokens, hit = [], 0
    for out in engine.submit(ids, GREEDY, images=images):
        tokens += out.token_ids
        hit = max(hit, out.prefix_hit_tokens)
    return tokens, hit


@pytest.fixture(scope="module", params=["llama4", "kimi_k25"])
def mm(request) -> Case:
    """The multimodal model of test_image_prompts (its fixtures, imported above)."""
    return request.getfixturevalue(f"{request.param.split('_')[0]}_case")


@pytest.fixture(scope="module")
def engine(mm):
    # Chunks of 16 tokens: the first image's rows (20 or 15) span two prefill calls.
    config = EngineConfig(
        max_batch=4,
        max_prefill_rows=4,
        prefill_budget=16,
        page_size=PAGE,
        max_model_len=96,
        aot=False,
        quick_compile=True,
    )
    with Engine(load_model(str(mm.path), "float32"), config) as engine:
        yield engine


def test_images_through_the_engine(mm, engine):
    assert engine.vision is not None and engine.vision.family == mm.vision.family
    images = request_images(mm, (1, 2))
    ids = mm.vision.expand_prompt(mm.template_ids, [i.pixels for i in images])
    want = transformers_greedy(mm, ids, images)
    got, hit = run(engine, ids, images)
    assert got == want and hit == 0
    stats = engine.stats()
    assert (stats["images"], stats["images_encoded"], stats["encoder_cache_hits"]) == (2, 2, 0)

    # The same images: every full page from the prefix cache, the rest's rows from the encoder's.
    again, hit = run(engine, ids, images)
    assert again == want and hit == len(ids) // PAGE * PAGE
    assert engine.stats()["images_encoded"] == 2

    # Another first image of the same size: the same ids, but no page holding its rows matches.
    other = request_images(mm, (7, 2))
    assert mm.vision.expand_prompt(mm.template_ids, [i.pixels for i in other]) == ids
    got, hit = run(engine, ids, other)
    first_row = ids.index(mm.vision.image_token_id)
    assert hit == first_row // PAGE * PAGE
    assert got == transformers_greedy(mm, ids, other)
    stats = engine.stats()
    assert (stats["images"], stats["images_encoded"]) == (6, 3)  # the new one alone
    assert stats["encoder_cache_hits"] >= 1  # the second image, past the reused pages

    # Both at once: each as alone.
    handles = [engine.submit(ids, GREEDY, images=i) for i in (images, other)]
    assert [h.result().token_ids for h in handles] == [want, got]


def test_bad_image_requests_are_refused(mm, engine):
    images = request_images(mm, (1, 2))
    ids = mm.vision.expand_prompt(mm.template_ids, [i.pixels for i in images])
    with pytest.raises(RequestError, match="placeholder tokens"):
        engine.submit(ids, GREEDY, images=images[:1])
    with pytest.raises(RequestError, match="placeholder tokens"):
        engine.submit(mm.template_ids, GREEDY, images=images)


def test_the_encoders_programs_compile_ahead_of_time(mm):
    """After `warm_up`, encoding images of any size the buckets hold compiles nothing more."""
    from jfire.vision import kimi_k25, llama4
    from jfire.vision.encoder import ImageEncoder

    ImageEncoder(mm.vision).warm_up()
    program = llama4.encode if mm.vision.family == "llama4" else kimi_k25.encode_padded
    compiled = program._cache_size()
    images = [i.pixels for i in request_images(mm, (3, 4))]
    for batch in (images[:1], images[1:], images):
        mm.vision.encode(batch)
    assert program._cache_size() == compiled
