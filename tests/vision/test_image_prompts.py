"""Prompts with images, end to end, against transformers' multimodal models (torch, CPU, float32).

A tiny random `Llama4ForConditionalGeneration` and a tiny random `Kimi_K25ForConditionalGeneration`
(MoonViT over a Kimi K2 shaped DeepSeek-V3 text model) are saved to disk; jfire loads the text
model (jfire.checkpoint.load) and the vision side (jfire.vision.model.load_vision_model) from
the same directory, expands a chat prompt's image placeholders, encodes the images and runs the
text decoder with their rows in place of the placeholder tokens' embeddings (`embeds`),
through a paged cache whose pages are shuffled. Compared with transformers' forward and
`generate` given the same pixel values: every position's logits, in one pass and in two chunks
split inside an image's tokens, and 16 greedy tokens. Each model gets two images of different
sizes (Llama 4: 2 x 2 tiles plus the global tile, and a single tile; Kimi: two patch grids).

The pixel values are jfire's (tests/vision/test_*_vision.py show them equal to transformers'
processors, bit for bit), so torchvision is not needed here.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from jfire.checkpoint.load import load_model
from jfire.models.family import init_cache
from jfire.vision.model import ImagePixels, KimiK25Vision, Llama4Vision, VisionModel, load_vision_model
from tests.tiny_models import COMMON, LLAMA4_TEXT, MLA_FAMILIES

TOLERANCE = 1e-4  # relative error (2-norm) of each position's logits
GREEDY_STEPS = 16
PAGE_SIZE = 8
MAX_LEN = 96

# Llama 4's image tokens in the tiny vocabulary (256 ids; text uses the ones below 250).
LLAMA4_TOKENS = {
    "<|patch|>": 250, "<|image_start|>": 251, "<|image_end|>": 252, "<|image|>": 253,
    "<|tile_x_separator|>": 254, "<|tile_y_separator|>": 255,
}  # fmt: skip
# A 56-pixel tile of 14-pixel patches: a 4x4 grid, 2x2 = 4 `<|patch|>` tokens per tile after the
# pixel shuffle, so a tile's tokens have an order to get right, and prompts stay short.
LLAMA4_VISION = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, image_size=56, patch_size=14,
    vision_output_dim=32, projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5,
    initializer_range=0.2,
)  # fmt: skip
LLAMA4_PREPROCESSOR = {"size": {"height": 56, "width": 56}, "max_patches": 4, "resample": 2}
# The tiny Kimi K2.5's images hold at most 1,024 patches (the release: 16,384), so that its
# encoder compiles 4 patch buckets (256 .. 2,048) rather than 8 (up to 32,768).
KIMI_PREPROCESSOR = {"media_proc_cfg": {"in_patch_limit": 1024}}

# Kimi K2.5's: `<|media_pad|>` and the chat template's frame around it.
KIMI_PAD, KIMI_BEGIN, KIMI_CONTENT, KIMI_END, KIMI_WORD_IMAGE = 250, 251, 252, 253, 100
KIMI_VISION = dict(
    patch_size=14, pos_emb_height=64, pos_emb_width=64, num_attention_heads=4, num_hidden_layers=2,
    hidden_size=64, intermediate_size=96,
)  # fmt: skip


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def assert_close_per_position(got, want, what: str) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    errors = [rel_err(got[t], want[t]) for t in range(want.shape[0])]
    worst = int(np.argmax(errors))
    assert errors[worst] < TOLERANCE, f"{what}: position {worst} has relative error {errors[worst]:.2e}"


def random_image(height: int, width: int, seed: int) -> Image.Image:
    """Noise over a gradient: structure across tiles and patches, detail within them."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 160, width)[None, :, None] + np.linspace(0, 60, height)[:, None, None]
    return Image.fromarray(np.clip(ramp + rng.integers(0, 96, (height, width, 3)), 0, 255).astype(np.uint8))


def text_ids(n: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.RandomState(seed).randint(3, 250, size=n)]


def randomise(model) -> None:
    """Biases and norms away from 0 and 1, DeepSeek's choice bias non-zero (tests/tiny_models.py)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.3 * torch.randn_like(b))


@dataclass
class Case:
    """One multimodal model, loaded by both sides, and a prompt with two images."""

    hf: torch.nn.Module
    cfg: object  # the jfire text family
    params: dict
    vision: VisionModel
    images: list[ImagePixels]
    template_ids: list[int]  # as the chat template writes it: one placeholder per image
    hf_image_inputs: dict  # pixel_values (and Kimi's grids) for transformers
    path: Path | None = None  # the saved directory (the engine tests load it)


def eager(config) -> None:
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"


# -- the two models ------------------------------------------------------------------------------


def tiny_llama4_with_vision() -> transformers.Llama4ForConditionalGeneration:
    """The tiny random Llama 4 with its vision tower (eager attention, randomised biases and
    norms), as these tests and the image server's (tests/serve/test_images_api.py) use it."""
    config = transformers.Llama4Config(
        text_config={**COMMON, **LLAMA4_TEXT},
        vision_config=LLAMA4_VISION,
        image_token_index=LLAMA4_TOKENS["<|patch|>"],
        boi_token_index=LLAMA4_TOKENS["<|image_start|>"],
        eoi_token_index=LLAMA4_TOKENS["<|image_end|>"],
    )
    for sub in (config, config.text_config, config.vision_config):
        eager(sub)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    randomise(model)
    return model


@pytest.fixture(scope="module")
def llama4_case(tmp_path_factory) -> Case:
    model = tiny_llama4_with_vision()
    path = tmp_path_factory.mktemp("llama4_mm")
    model.save_pretrained(path)
    save_word_tokenizer(path, LLAMA4_TOKENS)
    (path / "preprocessor_config.json").write_text(json.dumps(LLAMA4_PREPROCESSOR))

    vision = load_vision_model(path)
    assert isinstance(vision, Llama4Vision)
    # 60 x 100: 2 x 2 tiles (upscaled) and the global tile; 40 x 30: one tile, no global tile.
    images = [vision.preprocess(random_image(60, 100, seed=1)), vision.preprocess(random_image(40, 30, seed=2))]
    assert [p.grid for p in images] == [(2, 2), (1, 1)] and [p.num_tokens for p in images] == [20, 4]
    image = LLAMA4_TOKENS["<|image|>"]
    template = text_ids(5, seed=3) + [image] + text_ids(4, seed=4) + [image] + text_ids(3, seed=5)
    pixels = torch.from_numpy(np.concatenate([p.pixel_values for p in images]))
    return Case(model, *_text_model(path), vision, images, template, {"pixel_values": pixels}, path)


def save_word_tokenizer(path: Path, special: dict[str, int]) -> None:
    """A word-level tokenizer over the tiny vocabulary with `special` at their ids, saved as HF does."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(min(special.values()))} | special
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(special))
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(path)


@pytest.fixture(scope="module")
def kimi_case(tmp_path_factory) -> Case:
    _, _, kimi_k2 = MLA_FAMILIES["kimi_k2"]
    text = {**COMMON, **kimi_k2, "model_type": "deepseek_v3"}
    config = transformers.Kimi_K25Config(
        text_config=text,
        vision_config=KIMI_VISION,
        projection_hidden_size=KIMI_VISION["hidden_size"],
        image_token_id=KIMI_PAD,
        vision_start_token_id=KIMI_BEGIN,
        vision_end_token_id=KIMI_END,
        tie_word_embeddings=False,  # as released (the class's default ties them)
    )
    eager(config)
    for sub in (config.text_config, config.vision_config):
        eager(sub)
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(config).eval()
    randomise(model)
    with torch.no_grad():  # the tower's default init is near zero: make every part show
        for name, p in model.named_parameters():
            if name.startswith(("model.vision_tower", "model.mm_projector")):
                if "norm" in name and name.endswith("weight"):
                    p.copy_(1 + 0.3 * torch.randn_like(p))
                else:
                    p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("kimi_k25")
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(KIMI_PREPROCESSOR))
    as_released_text_names(path)

    vision = load_vision_model(path)
    assert isinstance(vision, KimiK25Vision)
    # 84 x 140: a 6 x 10 patch grid, 15 tokens; 50 x 60 padded to 56 x 84: 6 tokens.
    images = [vision.preprocess(random_image(84, 140, seed=1)), vision.preprocess(random_image(50, 60, seed=2))]
    assert [p.num_tokens for p in images] == [15, 6]
    frame = [KIMI_BEGIN, KIMI_WORD_IMAGE, KIMI_CONTENT, KIMI_PAD, KIMI_END]
    template = text_ids(5, seed=3) + frame + text_ids(4, seed=4) + frame + text_ids(3, seed=5)
    hf_inputs = {
        "pixel_values": torch.from_numpy(np.concatenate([p.pixel_values for p in images])),
        "image_grid_thw": torch.tensor([p.grid for p in images]),
    }
    return Case(model, *_text_model(path), vision, images, template, hf_inputs, path)


def as_released_text_names(path: Path) -> None:
    """transformers 5.25 saves Kimi K2.5's text layers as `language_model.model.blocks.{i}`: its
    reverse of the `blocks` -> `layers` rename it applies to the vision tower on load also hits
    the text model. The release (and what transformers loads either way) has `layers`."""
    from safetensors.numpy import load_file, save_file

    file = path / "model.safetensors"
    old, new = "language_model.model.blocks.", "language_model.model.layers."
    save_file({name.replace(old, new, 1): v for name, v in load_file(file).items()}, file, metadata={"format": "pt"})


def _text_model(path: Path):
    loaded = load_model(str(path), "float32")
    return loaded.config, loaded.params


@pytest.fixture(params=["llama4", "kimi_k25"])
def case(request) -> Case:
    return request.getfixturevalue({"llama4": "llama4_case", "kimi_k25": "kimi_case"}[request.param])


# -- jfire's side --------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def decoder_logits(cfg, params, tokens, positions, pages, table, embeds):
    hidden, pages = cfg.decoder(params, tokens, positions, pages, table, embeds=embeds)
    return cfg.logits(params, hidden), pages


def shuffled_cache(cfg, seed: int = 0):
    """One row's cache whose page table sends its positions to pages in a shuffled order, in
    every cache group (Llama 4 has a chunked and a global one)."""
    cache = init_cache(cfg, 1, MAX_LEN, jnp.float32, PAGE_SIZE)
    table = np.asarray(cache.pop("page_table"))
    per_row, rng = -(-MAX_LEN // PAGE_SIZE), np.random.default_rng(seed)
    groups = table.shape[1] // per_row
    shuffled = np.concatenate([rng.permutation(per_row) for _ in range(groups)]).astype(np.int32)
    return cache, jnp.asarray(shuffled[None])


def jfire_prompt(case: Case):
    """(expanded prompt ids, (values [t, e], mask [t])): the image rows aligned with the prompt."""
    ids = case.vision.expand_prompt(case.template_ids, case.images)
    return ids, case.vision.prompt_embeds(ids, case.vision.encode(case.images))


def run_chunks(case: Case, ids, embeds, bounds):
    """Logits [t, v] of the prompt fed in chunks ending at `bounds`, and the cache after. Each
    chunk is padded (position -1) to the whole prompt's length: one compiled program serves
    every chunk, and padding rows are shown to leave the cache alone."""
    values, mask = embeds
    width = len(ids)
    pages, table = shuffled_cache(case.cfg)
    out, start = [], 0
    for end in bounds:
        n = end - start
        tokens, positions = np.zeros((1, width), np.int32), np.full((1, width), -1, np.int32)
        tokens[0, :n], positions[0, :n] = ids[start:end], np.arange(start, end)
        rows, at = np.zeros((1, width, values.shape[1]), values.dtype), np.zeros((1, width), bool)
        rows[0, :n], at[0, :n] = values[start:end], mask[start:end]
        logits, pages = decoder_logits(case.cfg, case.params, tokens, positions, pages, table, (rows, at))
        out.append(np.asarray(logits[0, :n]))
        start = end
    return np.concatenate(out), (pages, table)


# -- the tests -----------------------------------------------------------------------------------


def test_placeholders_are_transformers_expansion(case):
    ids = case.vision.expand_prompt(case.template_ids, case.images)
    if isinstance(case.vision, KimiK25Vision):
        # The processor repeats the template's one pad; the frame around it stays.
        runs = np.split(np.asarray(ids), np.flatnonzero(np.asarray(ids) == KIMI_CONTENT) + 1)[1:]
        assert [int((run == KIMI_PAD).sum()) for run in runs] == [15, 6]
        assert all(run[int((run == KIMI_PAD).sum())] == KIMI_END for run in runs)
    else:
        patch, x_sep, y_sep = (LLAMA4_TOKENS[t] for t in ("<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"))
        first = [LLAMA4_TOKENS["<|image_start|>"], *([*[patch] * 4, x_sep, *[patch] * 4, y_sep] * 2)]
        first += [LLAMA4_TOKENS["<|image|>"], *[patch] * 4, LLAMA4_TOKENS["<|image_end|>"]]
        second = [LLAMA4_TOKENS["<|image_start|>"], LLAMA4_TOKENS["<|image|>"], *[patch] * 4]
        second += [LLAMA4_TOKENS["<|image_end|>"]]
        assert ids == case.template_ids[:5] + first + case.template_ids[6:10] + second + case.template_ids[11:]
    assert sum(i == case.vision.image_token_id for i in ids) == case.vision.encode(case.images).shape[0]


def test_logits_match_transformers_in_one_pass_and_in_chunks(case):
    ids, embeds = jfire_prompt(case)
    with torch.no_grad():
        want = case.hf(input_ids=torch.tensor([ids]), **case.hf_image_inputs).logits[0].numpy()
    whole, _ = run_chunks(case, ids, embeds, [len(ids)])
    assert_close_per_position(whole, want, "one pass")
    # Split three tokens into the first image's rows, off a page boundary: the second chunk's
    # image rows and positions must follow on from the first's.
    split = ids.index(case.vision.image_token_id) + 3
    assert split % PAGE_SIZE and embeds[1][split - 1] and embeds[1][split]
    chunked, _ = run_chunks(case, ids, embeds, [split, len(ids)])
    assert_close_per_position(chunked, want, "two chunks")


def test_greedy_tokens_match_transformers_generate(case):
    ids, embeds = jfire_prompt(case)
    with torch.no_grad():
        out = case.hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=GREEDY_STEPS,
            do_sample=False,
            **case.hf_image_inputs,
        )
    want = out[0, len(ids) :].tolist()
    assert len(want) == GREEDY_STEPS  # no EOS among them: every step is compared

    logits, (pages, table) = run_chunks(case, ids, embeds, [len(ids)])
    got = [int(np.argmax(logits[-1]))]
    for position in range(len(ids), len(ids) + GREEDY_STEPS - 1):
        step, pages = decoder_logits(
            case.cfg, case.params, jnp.asarray([[got[-1]]]), jnp.asarray([[position]]), pages, table, None
        )
        got.append(int(np.argmax(step[0, -1])))
    assert got == want


def test_text_only_models_have_no_vision(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama4_text"}))
    assert load_vision_model(tmp_path) is None
