"""Kimi K2.5's image side against transformers: jfire.vision.kimi_k25_preprocess against
`Kimi_K25ImageProcessor` / `Kimi_K25Processor` (pixels bit for bit, grids, placeholder
counts), and jfire.vision.kimi_k25 against `Kimi_K25Model.get_image_features` on a tiny random
model (float32, several images of different sizes in one call)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from jfire.vision import kimi_k25 as kk
from jfire.vision import kimi_k25_preprocess as kp
from tests.vision.torchvision_reference import import_torchvision

TOLERANCE = 1e-4  # max abs difference, relative to the reference output's largest magnitude

# The release's own names for the tiny model below (remote-code config, `vt_*`).
RELEASED_VISION_CONFIG = {
    "patch_size": 14,
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "init_pos_emb_time": 4,
    "merge_kernel_size": [2, 2],
    "vt_hidden_size": 64,
    "vt_intermediate_size": 96,
    "vt_num_attention_heads": 4,
    "vt_num_hidden_layers": 2,
    "mm_hidden_size": 64,
    "text_hidden_size": 48,
    "projector_ln_eps": 1e-5,
    "projector_hidden_act": "gelu",
}


def _image(height: int, width: int, seed: int, mode: str = "RGB") -> Image.Image:
    """Noise over smooth bands: every resize tap matters, and the bands give it structure."""
    rng = np.random.default_rng(seed)
    rows, cols = np.mgrid[0:height, 0:width]
    smooth = 128 + 60 * np.sin(cols / 7.0) + 40 * np.cos(rows / 5.0)
    channels = [smooth + rng.normal(0, 30, (height, width)) for _ in range(4)]
    rgba = np.clip(np.stack(channels, -1), 0, 255).astype(np.uint8)
    return Image.fromarray(rgba, "RGBA").convert(mode) if mode != "RGBA" else Image.fromarray(rgba, "RGBA")


@pytest.fixture(scope="module")
def transformers_kimi(tmp_path_factory):
    """(tiny Kimi_K25ForConditionalGeneration, the directory transformers saved it to)."""
    import torch
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = dict(
        model_type="deepseek_v3",
        vocab_size=256,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    vision = dict(
        patch_size=14,
        pos_emb_height=64,
        pos_emb_width=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
    )
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=64)
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    # Norms away from (1, 0) and large enough weights that every part shows in the output.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("model.vision_tower", "model.mm_projector")):
                if "norm" in name and name.endswith("weight"):
                    p.copy_(1 + 0.3 * torch.randn_like(p))
                else:
                    p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("kimi_k25_tiny")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def released_dir(transformers_kimi, tmp_path_factory):
    """The tiny model's vision tensors under the release's names, with a release-style config."""
    from safetensors.numpy import load_file, save_file

    _, hf_path = transformers_kimi
    renames = {
        "vision_tower.encoder.patch_embed.": "vision_tower.patch_embed.",
        "model.mm_projector.pre_norm.": "mm_projector.pre_norm.",
    }
    tensors = {}
    for name, value in load_file(hf_path / "model.safetensors").items():
        for old, new in renames.items():
            name = name.replace(old, new) if name.startswith(old) else name
        if name.startswith(("vision_tower.", "mm_projector.")):
            tensors[name] = value
    path = tmp_path_factory.mktemp("kimi_k25_released")
    save_file(tensors, path / "model.safetensors")
    hf_config = json.loads((hf_path / "config.json").read_text())
    released = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "media_placeholder_token_id": 163605,
        "text_config": hf_config["text_config"],
        "vision_config": RELEASED_VISION_CONFIG,
    }
    (path / "config.json").write_text(json.dumps(released))
    return path


def _config(path) -> kk.KimiK25VisionConfig:
    return kk.KimiK25VisionConfig.from_hf(json.loads((path / "config.json").read_text()))


def _reference_features(model, pixel_values, grids) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixel_values), torch.from_numpy(grids))
    return torch.cat(out.pooler_output).numpy()


def _relative_error(out, ref) -> float:
    return float(np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max())


def test_config_reads_the_released_and_the_transformers_names_alike(transformers_kimi, released_dir):
    _, hf_path = transformers_kimi
    assert _config(released_dir) == _config(hf_path)
    assert _config(hf_path) == kk.KimiK25VisionConfig(
        hidden_size=64, num_heads=4, num_layers=2, intermediate_size=96, text_hidden_size=48
    )


def test_config_refuses_what_is_not_built(released_dir):
    config = json.loads((released_dir / "config.json").read_text())
    config["vision_config"] = dict(config["vision_config"], mm_projector_type="patchmergerv2")
    with pytest.raises(ValueError, match="mm_projector_type"):
        kk.KimiK25VisionConfig.from_hf(config)


# Images of different sizes (a tall one, one a single merge group) in one call: attention must
# stay within each image.
ENCODER_IMAGES = [(84, 140), (50, 60), (120, 30), (20, 17)]


@pytest.mark.parametrize("where", ["released", "transformers"])
def test_encoder_matches_transformers_on_several_images(transformers_kimi, released_dir, where):
    model, hf_path = transformers_kimi
    path = released_dir if where == "released" else hf_path
    cfg = _config(path)
    params = jax.device_put(kk.load_params(path, cfg))
    pixels, grids = kp.preprocess([_image(h, w, seed=i) for i, (h, w) in enumerate(ENCODER_IMAGES)])
    ref = _reference_features(model, pixels, grids)
    out = kk.encode(params, cfg, pixels, grids)
    tokens = sum(kp.num_placeholder_tokens(h, w) for h, w in ENCODER_IMAGES)
    assert out.shape == ref.shape == (tokens, 48)
    assert _relative_error(out, ref) < TOLERANCE
    # Alone, the first image gives the rows it gave in the batch: nothing crossed images.
    first = grids[0, 1] * grids[0, 2]
    alone = kk.encode(params, cfg, pixels[:first], grids[:1])
    assert _relative_error(alone, ref[: len(alone)]) < TOLERANCE


def test_a_larger_bucket_gives_the_same_tokens(transformers_kimi):
    _, hf_path = transformers_kimi
    cfg = _config(hf_path)
    params = jax.device_put(kk.load_params(hf_path, cfg))
    pixels, grids = kp.preprocess([_image(84, 140, seed=0), _image(50, 60, seed=1)])
    tight = np.asarray(kk.encode(params, cfg, pixels, grids))
    assert kk.patch_bucket(len(pixels)) == 256
    padded = np.asarray(kk.encode(params, cfg, pixels, grids, buckets=(1024,)))
    np.testing.assert_allclose(padded, tight, rtol=0, atol=1e-5 * np.abs(tight).max())


def test_bfloat16_weights_load_and_stay_near_float32(transformers_kimi):
    """A sanity check of the bfloat16 path, not an equivalence: bf16 rounding is ~4e-3."""
    model, hf_path = transformers_kimi
    cfg = _config(hf_path)
    params = kk.load_params(hf_path, cfg, dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype(jnp.bfloat16)}
    pixels, grids = kp.preprocess([_image(84, 140, seed=0)])
    out = kk.encode(jax.device_put(params), cfg, pixels, grids)
    assert out.dtype == jnp.bfloat16
    assert _relative_error(out, _reference_features(model, pixels, grids)) < 0.05


def test_the_release_sized_encoder_lowers_for_cuda():
    cfg = kk.KimiK25VisionConfig()
    params = jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16),
        kk.param_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    size = 16384
    inputs = [((size, 3 * 14 * 14), jnp.float32), ((size,), jnp.int32), ((size, 2), jnp.int32)]
    inputs += [((size, 16), jnp.int32), ((size, 16), jnp.float32), ((size // 4, 4), jnp.int32)]
    traced = kk.encode_padded.trace(params, cfg, *(jax.ShapeDtypeStruct(s, d) for s, d in inputs))
    lowered = traced.lower(lowering_platforms=("cuda",))
    assert lowered.out_info.shape == (size // 4, 7168)


# (height, width, mode, limits): the release's limits unless given. 2100 x 1900 has more than
# 16384 patches and is resized down; 20 x 17 is smaller than one 28 x 28 merge group; the
# reduced limits resize moderate images along one or both axes.
PREPROCESS_CASES = [
    (2100, 1900, "RGB", None),
    (20, 17, "RGB", None),
    (500, 90, "RGB", None),
    (300, 400, "RGB", dict(max_patches=100)),
    (500, 90, "RGB", dict(max_patches_per_side=16)),
    (95, 333, "RGBA", dict(max_patches=30)),
    (64, 47, "L", None),
]


@pytest.mark.parametrize("height,width,mode,limits", PREPROCESS_CASES)
def test_preprocess_matches_transformers_bit_for_bit(height, width, mode, limits):
    import_torchvision()
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    cfg = dataclasses.replace(kp.PreprocessConfig(), **(limits or {}))
    kwargs = dict(
        max_patches=cfg.max_patches,
        size={"max_height": cfg.max_patches_per_side, "max_width": cfg.max_patches_per_side},
    )
    image = _image(height, width, seed=height + width, mode=mode)
    ref = Kimi_K25ImageProcessor(**kwargs)(images=[image], return_tensors="np")
    pixels, grids = kp.preprocess([image], cfg)
    np.testing.assert_array_equal(grids, ref["image_grid_thw"])
    assert pixels.dtype == ref["pixel_values"].dtype == np.float32
    np.testing.assert_array_equal(pixels, ref["pixel_values"])


def test_several_images_concatenate_as_transformers_does():
    import_torchvision()
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    images = [_image(120, 30, seed=1), _image(20, 17, seed=2), _image(120, 30, seed=3), _image(84, 140, seed=4)]
    ref = Kimi_K25ImageProcessor()(images=images, return_tensors="np")
    pixels, grids = kp.preprocess(images)
    np.testing.assert_array_equal(grids, ref["image_grid_thw"])
    np.testing.assert_array_equal(pixels, ref["pixel_values"])


def test_placeholder_counts_match_the_processors_expansion(monkeypatch):
    import_torchvision()
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, processing_utils
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    words = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1, "<|media_pad|>": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|media_pad|>"]})
    # The processor checks each part's class against transformers' top-level names, which in a
    # pytest run were bound to stand-ins before torchvision could be imported (see above).
    monkeypatch.setattr(
        processing_utils.ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg)
    )
    processor = Kimi_K25Processor(Kimi_K25ImageProcessor(), tokenizer, Kimi_K25VideoProcessor())
    sizes = [(2100, 1900), (20, 17), (500, 90), (300, 400), (57, 1000)]
    out = processor(
        text=["hi " + " hi ".join(["<|media_pad|>"] * len(sizes)) + " hi"],
        images=[_image(h, w, seed=0) for h, w in sizes],
        return_tensors="np",
    )
    ids = out["input_ids"][0]
    runs = np.split(ids, np.flatnonzero(ids == 1))[1:-1]  # the pad run after each "hi"
    assert [int((run == 2).sum()) for run in runs] == [kp.num_placeholder_tokens(h, w) for h, w in sizes]
    assert [processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens] == [
        [kp.num_placeholder_tokens(h, w) for h, w in sizes]
    ]
