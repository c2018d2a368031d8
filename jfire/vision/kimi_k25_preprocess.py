"""Kimi K2.5 image preprocessing, as transformers' `Kimi_K25ImageProcessor` computes it, in
numpy + Pillow (no torch in jfire).

  1. RGB (transparency composited onto white, as transformers' `convert_to_rgb`).
  2. NaViT resize: shrink (never grow) so the image has at most `max_patches` 14x14 patches and
     at most `max_patches_per_side` patches along either side, then zero-pad bottom/right to a
     multiple of patch * merge (28) so the 2x2 merge tiles the patch grid.
  3. Normalise: (pixel - 127.5) / 127.5 in float32 (mean = std = 0.5 after rescaling by 1/255;
     transformers fuses both into one subtract and divide, done here the same way).
  4. Patchify in raster order: [grid_h * grid_w, 3, 14, 14] per image, concatenated over
     images, with the grid (t=1, h, w) of each image.

The resize reproduces torch's uint8 antialiased bicubic kernel (the path torchvision takes for
a uint8 CPU tensor): Keys cubic with a = -0.5 stretched by the downscale factor, weights
normalised in float64, rounded to int16 fixed point, a horizontal then a vertical pass each
rounded back to uint8. The arithmetic after the weights is integer, so the result is bit for
bit torch's (and differs from Pillow's own resize by 1 in a few pixels: Pillow keeps 22
fraction bits where torch keeps at most 15).

Each image expands to grid_h * grid_w / 4 placeholder tokens (`media_placeholder_token_id`,
163605 in the release), one per merged 2x2 patch group.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

IMAGE_TOKEN_ID = 163605  # `<|media_pad|>`


@dataclasses.dataclass(frozen=True)
class PreprocessConfig:
    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384  # `in_patch_limit` in the release's preprocessor_config.json
    max_patches_per_side: int = 512  # `patch_limit_on_one_side`; transformers' size.max_height
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)  # per RGB channel
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_hf(cls, preprocessor_config: Mapping[str, Any]) -> PreprocessConfig:
        """From a preprocessor_config.json: the release's (`media_proc_cfg`) or transformers'."""
        c = preprocessor_config.get("media_proc_cfg", preprocessor_config)
        merge = c.get("merge_kernel_size", c.get("merge_size", cls.merge_size))
        size = c.get("size") or {}
        return cls(
            patch_size=int(c.get("patch_size", cls.patch_size)),
            merge_size=int(merge[0] if isinstance(merge, (list, tuple)) else merge),
            max_patches=int(c.get("in_patch_limit", c.get("max_patches", cls.max_patches))),
            max_patches_per_side=int(
                c.get("patch_limit_on_one_side", size.get("max_height", cls.max_patches_per_side))
            ),
            image_mean=tuple(float(v) for v in c.get("image_mean", cls.image_mean)),
            image_std=tuple(float(v) for v in c.get("image_std", cls.image_std)),
        )


def resized_and_padded_size(height: int, width: int, cfg: PreprocessConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)): transformers' `navit_resize`, float for float."""
    p = cfg.patch_size
    patches_h = max(1.0, height // p)
    patches_w = max(1.0, width // p)
    scale = min(
        1.0,
        math.sqrt(cfg.max_patches / (patches_h * patches_w)),
        (cfg.max_patches_per_side * p) / height,
        (cfg.max_patches_per_side * p) / width,
    )
    new_h = min(max(1, int(height * scale)), cfg.max_patches_per_side * p)
    new_w = min(max(1, int(width * scale)), cfg.max_patches_per_side * p)
    factor = cfg.merge_size * p
    return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def patch_grid(height: int, width: int, cfg: PreprocessConfig) -> tuple[int, int, int]:
    """(t, h, w) in patches for an image of this pixel size: t is 1 for an image."""
    _, (pad_h, pad_w) = resized_and_padded_size(height, width, cfg)
    return 1, pad_h // cfg.patch_size, pad_w // cfg.patch_size


def num_placeholder_tokens(height: int, width: int, cfg: PreprocessConfig = PreprocessConfig()) -> int:
    """How many placeholder tokens an image of this pixel size expands to in the prompt."""
    t, h, w = patch_grid(height, width, cfg)
    return t * h * w // cfg.merge_size**2


def to_rgb_array(image: Image.Image | np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3]; transparency composited onto white as transformers does."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"expected a uint8 [H, W, 3] array, got {image.dtype} {image.shape}")
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


def _keys_cubic_antialias(x: np.ndarray) -> np.ndarray:
    # a = -0.5 (not the -0.75 of non-antialiased bicubic): torch's and Pillow's antialias filter.
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _int16_resize_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(first tap [out], int weights [out, taps], fraction bits) of torch's
    `_compute_index_ranges_int16_weights` for antialiased bicubic, align_corners=False."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    max_taps = math.ceil(support) * 2 + 1
    center = scale * (np.arange(out_size) + 0.5)
    # Truncation toward zero, as the C++ static_cast<int64_t> does.
    first = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    count = np.clip(np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - first, 0, max_taps)
    offsets = np.arange(max_taps)
    weights = _keys_cubic_antialias((offsets + first[:, None] - center[:, None] + 0.5) * invscale)
    weights = np.where(offsets < count[:, None], weights, 0.0)
    total = np.zeros(out_size)
    for k in range(max_taps):  # summed tap by tap, in the C++ order, so the rounding below agrees
        total += weights[:, k]
    weights = np.where(total[:, None] != 0.0, weights / np.where(total == 0.0, 1.0, total)[:, None], weights)
    w_max = weights.max()
    bits = 0
    while bits < 22 and int(0.5 + w_max * (1 << (bits + 1))) < (1 << 15):
        bits += 1
    # Round half away from zero, then truncate, as the C++ does.
    scaled = weights * (1 << bits)
    ints = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64)
    return first, ints, bits


def _resize_axis(image: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One separable pass over `axis` of a uint8 [H, W, C] image, in torch's fixed point."""
    in_size = image.shape[axis]
    if in_size == out_size:
        return image
    first, weights, bits = _int16_resize_taps(in_size, out_size)
    taps = np.minimum(first[:, None] + np.arange(weights.shape[1]), in_size - 1)  # zero weight past the end
    src = np.ascontiguousarray(np.moveaxis(image, axis, 0), np.int32)  # [in, other, C]; sums < 2**31
    acc = np.full((out_size,) + src.shape[1:], 1 << (bits - 1), np.int32)
    for k in range(weights.shape[1]):
        acc += src[taps[:, k]] * weights[:, k, None, None].astype(np.int32)
    out = np.clip(acc >> bits, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def resize_bicubic_antialias(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, C] -> uint8 [height, width, C]: horizontal pass first, as torch does."""
    return _resize_axis(_resize_axis(image, width, axis=1), height, axis=0)


def preprocess_one(
    image: Image.Image | np.ndarray, cfg: PreprocessConfig = PreprocessConfig()
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(patches float32 [h * w, 3, patch, patch] in raster order, grid (1, h, w))."""
    rgb = to_rgb_array(image)
    (new_h, new_w), (pad_h, pad_w) = resized_and_padded_size(rgb.shape[0], rgb.shape[1], cfg)
    resized = resize_bicubic_antialias(rgb, new_h, new_w)
    padded = np.zeros((pad_h, pad_w, 3), np.uint8)
    padded[:new_h, :new_w] = resized
    # transformers folds the 1/255 rescale into mean and std (float32) and normalises once.
    mean = np.asarray(cfg.image_mean, np.float32) * np.float32(255.0)
    std = np.asarray(cfg.image_std, np.float32) * np.float32(255.0)
    pixels = (padded.astype(np.float32) - mean) / std  # [H, W, 3]
    p = cfg.patch_size
    gh, gw = pad_h // p, pad_w // p
    patches = pixels.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    return np.ascontiguousarray(patches), (1, gh, gw)


def preprocess(
    images: Sequence[Image.Image | np.ndarray], cfg: PreprocessConfig = PreprocessConfig()
) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values float32 [total patches, 3, patch, patch], grids int64 [images, 3]): the
    `pixel_values` and `image_grid_thw` transformers' processor returns."""
    done = [preprocess_one(image, cfg) for image in images]
    return np.concatenate([p for p, _ in done]), np.asarray([g for _, g in done], np.int64)
