"""Llama 4's image side against transformers: the preprocessing (Llama4ImageProcessor, with
torchvision from tests/vision/torchvision_reference.py), the prompt's placeholder tokens
(Llama4Processor) and the vision tower + projector (Llama4ForConditionalGeneration's
get_image_features) of a tiny random model.

The tiny model keeps the released geometry (336-pixel tiles, 14-pixel patches: a 24x24 grid,
576 patches + CLS, 144 tokens per tile after the shuffle) and shrinks only the widths and the
depth. transformers would accept a smaller consistent tile (28 / 14, as tests/tiny_models.py's
llama4_mm does), but its 2x2 grid and single shuffled token cannot tell a transposed RoPE
axis, a mis-ordered pixel shuffle or patch order from the right one; at these widths the
full-size grid still runs in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from jfire.tokenizer import Tokenizer
from jfire.vision import llama4 as vision
from jfire.vision.llama4_preprocess import (
    ImageTokenIds,
    Llama4ImageProcessing,
    image_placeholder_ids,
    preprocess,
    tokens_per_tile,
)
from tests.vision.torchvision_reference import import_torchvision

VISION = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=336, patch_size=14,
    vision_output_dim=48, projector_input_dim=48, projector_output_dim=48, pixel_shuffle_ratio=0.5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.2,
)  # fmt: skip
TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=2,
)  # fmt: skip
IMAGE_TOKENS = ["<|image_start|>", "<|image_end|>", "<|patch|>", "<|tile_x_separator|>",
                "<|tile_y_separator|>", "<|image|>"]  # fmt: skip
CHAT_TOKENS = ["<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>"]


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Noise over a gradient: per-pixel detail for the resampling, structure across tiles."""
    rng = np.random.default_rng(seed)
    channels = len(Image.new(mode, (1, 1)).getbands())
    ramp = np.linspace(0, 160, width)[None, :, None] + np.linspace(0, 60, height)[:, None, None]
    pixels = np.clip(ramp + rng.integers(0, 96, (height, width, channels)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


@pytest.fixture(scope="module")
def hf_image_processor():
    import_torchvision()
    from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor

    return Llama4ImageProcessor()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """(the saved directory, the float32 HF model), biases, norms and embeddings randomised."""
    config = transformers.Llama4Config(
        vision_config=VISION, text_config=TEXT, image_token_index=500, boi_token_index=501, eoi_token_index=502
    )
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("vision_model."):
                continue
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("class_embedding", "positional_embedding_vlm")):
                p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("llama4_vision")
    model.save_pretrained(path)
    return path, model


# -- preprocessing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "width,height,mode",
    [
        (500, 300, "RGB"),  # 1x2 tiles + global, upscaled to one tile high
        (1000, 700, "RGB"),  # 3x3 tiles + global, downscaled
        (100, 60, "RGB"),  # smaller than a tile: upscaled into one tile, no global tile
        (300, 1200, "RGB"),  # tall: 4x1 tiles
        (5000, 200, "RGB"),  # far wider than 16 tiles allow: 1x15, heavy downscale
        (673, 336, "RGBA"),  # transparency composited onto white; 1x3 tiles
        (337, 2, "L"),  # greyscale, a sliver thinner than a patch
    ],
)
def test_preprocessing_equals_hf(hf_image_processor, width, height, mode):
    image = random_image(width, height, mode, seed=width + height)
    if mode == "RGBA":
        alpha = np.asarray(image)[..., 3].copy()
        alpha[: height // 2] = 255  # half opaque, half random transparency
        image.putalpha(Image.fromarray(alpha))
    ref = hf_image_processor(image, return_tensors="pt")
    ours = preprocess(image)
    # transformers returns bf16; float32 holds it exactly, so equality is the check.
    assert ours.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"].float().numpy())
    assert list(ours.aspect_ratio) == ref["aspect_ratios"][0].tolist()


def test_settings_from_released_preprocessor_config():
    released = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "max_patches": 16, "resample": 2,
        "rescale_factor": 0.00392156862745098, "resize_to_max_canvas": False, "size": {"height": 336, "width": 336},
    }  # fmt: skip
    assert Llama4ImageProcessing.from_hf(released) == Llama4ImageProcessing()


# -- prompt placeholders -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level tokenizer with Llama 4's chat and image special tokens, saved as HF does."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(CHAT_TOKENS + IMAGE_TOKENS)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot|>"
    )
    path = tmp_path_factory.mktemp("llama4_tokenizer")
    tok.save_pretrained(path)
    return path


def test_placeholder_tokens_equal_hf_processor(hf_image_processor, tokenizer_dir):
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    processor = Llama4Processor(image_processor=hf_image_processor, tokenizer=hf_tok)
    images = [random_image(500, 300), random_image(100, 60, seed=1), random_image(1000, 700, seed=2)]
    content = [{"type": "image"}, {"type": "text", "text": "What differs between"},
               {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]  # fmt: skip
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ref = processor(text=prompt, images=images, return_tensors="pt")["input_ids"][0].tolist()

    tok = Tokenizer.from_dir(tokenizer_dir)
    ids = ImageTokenIds.from_vocab(tok.special_token_id)
    per_tile = tokens_per_tile(336, processor.patch_size, 0.5)
    expected = []
    image_iter = iter(images)
    for token in tok.encode(prompt):  # the template's one <|image|> per image, expanded in place
        if token == ids.image:
            expected += image_placeholder_ids(preprocess(next(image_iter)).aspect_ratio, per_tile, ids)
        else:
            expected.append(token)
    assert per_tile == 144
    assert expected == ref


# -- tower and projector -------------------------------------------------------------------------


def jfire_config(model) -> vision.Llama4VisionConfig:
    return vision.Llama4VisionConfig.from_hf(model.config.vision_config.to_dict(), model.config.text_config.hidden_size)


def test_tower_and_projector_equal_hf(tiny_model):
    path, model = tiny_model
    cfg = jfire_config(model)
    assert cfg.tokens_per_tile == 144
    # Two tiled images' worth of tiles (1x2 + global, 4x1 + global): real preprocessed pixels.
    pixels = np.concatenate([preprocess(random_image(500, 300)).pixel_values,
                             preprocess(random_image(300, 1200, seed=3)).pixel_values])  # fmt: skip
    with torch.no_grad():
        ref = model.get_image_features(pixel_values=torch.from_numpy(pixels)).pooler_output
    ref = ref.reshape(-1, ref.shape[-1]).numpy()  # what masked_scatter puts in the <|patch|> slots
    params = vision.load_params(path, cfg, np.float32)
    ours = np.asarray(vision.encode(params, cfg, pixels))
    assert ours.shape == ref.shape == (8 * 144, cfg.text_hidden_size)
    scale = np.abs(ref).max()
    error = np.abs(ours - ref).max() / scale
    assert scale > 0.1 and error < 1e-4, (scale, error)


def test_released_config():
    """Scout's vision_config (a transformers 4.51 config.json: rope_theta, not rope_parameters)."""
    released = json.loads(
        (Path(__file__).parents[1] / "data" / "llama4-scout-17b-16e-instruct" / "config.json").read_text()
    )
    cfg = vision.Llama4VisionConfig.from_hf(released["vision_config"], released["text_config"]["hidden_size"])
    assert (cfg.head_dim, cfg.patches_per_side, cfg.tokens_per_tile, cfg.rope_theta) == (88, 24, 144, 10000.0)
    assert vision.param_shapes(cfg)["projector"] == (4096, 5120)


def test_loader_reads_every_vision_tensor(tiny_model):
    path, model = tiny_model
    saved = {name for name in model.state_dict() if name.startswith(("vision_model.", "multi_modal_projector."))}
    assert set(vision.hf_names(jfire_config(model))) == saved


def test_bf16_checkpoint_loads_as_its_values(tiny_model, tmp_path):
    path, model = tiny_model
    cfg = jfire_config(model)
    model.save_pretrained(tmp_path, state_dict={k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    from_bf16 = vision.load_params(tmp_path, cfg, jnp.bfloat16)
    from_f32 = vision.load_params(path, cfg, np.float32)
    for a, b in zip(jax.tree.leaves(from_bf16), jax.tree.leaves(from_f32), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(a.dtype))
