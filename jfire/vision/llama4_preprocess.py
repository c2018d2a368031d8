"""Llama 4's image preprocessing and prompt placeholders, in numpy and Pillow.

Mirrors transformers 5's `Llama4ImageProcessor` (torchvision backend) and `Llama4Processor`:
  1. RGB (transparency composited onto white);
  2. the best "canvas" of whole tiles among every tiling of up to `max_tiles` tiles;
  3. resize (aspect ratio kept, upscaling limited to one tile) to fit the canvas, pad it
     right/bottom with zeros, normalise, split into tiles;
  4. with more than one tile, the whole image squashed to one tile appended as a global tile.

The resize is torchvision's `resize(uint8 tensor, BILINEAR, antialias=True)`, which on CPUs
with AVX2/AVX-512 (and on aarch64) runs torch's native uint8 kernel: Pillow-SIMD's separable
triangle filter with int16 fixed-point weights, a horizontal pass then a vertical one, each
rounded to uint8. Pillow's own `resize` uses other fixed-point weights and lands 1-2 levels
off on a few percent of pixels, so that kernel is reproduced here in integer arithmetic and
the result is bit-exact. (On an x86 CPU without AVX2 torchvision instead resizes in float32 and
rounds; jfire does not follow that path.) Llama 4 then rescales and normalises in bfloat16,
which is reproduced with a lookup table over the 256 byte values, so the pixel values here
equal transformers' bf16 ones exactly (returned as float32, which holds every bf16 value).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import ml_dtypes
import numpy as np
from PIL import Image

from jfire.errors import JfireError

# transformers' PILImageResampling.BILINEAR: the only resampling Llama 4's processor uses.
_PIL_BILINEAR = 2


@dataclasses.dataclass(frozen=True)
class Llama4ImageProcessing:
    """The image processor's settings (preprocessor_config.json), released values as defaults."""

    tile_size: int = 336
    max_tiles: int = 16
    resize_to_max_canvas: bool = False
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_hf(cls, config: dict) -> Llama4ImageProcessing:
        size = config.get("size") or {"height": cls.tile_size, "width": cls.tile_size}
        if size["height"] != size["width"]:
            raise JfireError(f"Llama 4 tiles are square; preprocessor size is {size}")
        if config.get("resample", _PIL_BILINEAR) != _PIL_BILINEAR:
            raise JfireError(f"jfire resizes Llama 4 images bilinearly only; the config asks for {config['resample']}")
        return cls(
            tile_size=size["height"],
            max_tiles=config.get("max_patches", cls.max_tiles),
            resize_to_max_canvas=config.get("resize_to_max_canvas", cls.resize_to_max_canvas),
            rescale_factor=config.get("rescale_factor", cls.rescale_factor),
            image_mean=tuple(config.get("image_mean", cls.image_mean)),
            image_std=tuple(config.get("image_std", cls.image_std)),
        )


@dataclasses.dataclass(frozen=True)
class Llama4Pixels:
    pixel_values: np.ndarray  # [tiles (+1 global when tiles > 1), 3, tile, tile] float32
    aspect_ratio: tuple[int, int]  # (tiles high, tiles wide) of the canvas, global tile not counted


def preprocess(image: Image.Image, settings: Llama4ImageProcessing = Llama4ImageProcessing()) -> Llama4Pixels:
    rgb = to_rgb(image).transpose(2, 0, 1)  # [3, H, W] uint8
    tile = settings.tile_size
    canvas = best_canvas(rgb.shape[1:], supported_canvases(settings.max_tiles, tile), settings.resize_to_max_canvas)
    resized = resize_bilinear_uint8(rgb, resized_size(rgb.shape[1:], canvas, tile, settings.resize_to_max_canvas))
    padded = np.zeros((3, *canvas), np.uint8)
    padded[:, : resized.shape[1], : resized.shape[2]] = resized
    rows, cols = canvas[0] // tile, canvas[1] // tile
    tiles = normalise(split_into_tiles(padded, rows, cols), settings)
    if rows * cols > 1:
        global_tile = normalise(resize_bilinear_uint8(rgb, (tile, tile))[None], settings)
        tiles = np.concatenate([tiles, global_tile])
    return Llama4Pixels(tiles, (rows, cols))


def to_rgb(image: Image.Image) -> np.ndarray:
    """[H, W, 3] uint8; transparency composited onto white as transformers does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(image.convert("RGB"))


# -- choosing the canvas -------------------------------------------------------------------------


def supported_canvases(max_tiles: int, tile: int) -> list[tuple[int, int]]:
    """(height, width) in pixels of every tiling of 1..max_tiles tiles, in transformers' order
    (grouped by aspect ratio as first met counting down from max_tiles): ties below are broken
    by the first of equal area, so the order is part of the result."""
    by_ratio: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for count in range(max_tiles, 0, -1):
        for rows in sorted(_divisors(count)):
            by_ratio[rows / (count // rows)].append((rows, count // rows))
    return [(rows * tile, cols * tile) for tilings in by_ratio.values() for rows, cols in tilings]


def _divisors(n: int) -> set[int]:
    return {d for i in range(1, int(n**0.5) + 1) if n % i == 0 for d in (i, n // i)}


def best_canvas(image_hw, canvases: list[tuple[int, int]], resize_to_max_canvas: bool) -> tuple[int, int]:
    """The canvas needing the least upscaling (or, if every one downscales, the least
    downscaling) without distortion; the smallest area among equals. The scales are float32
    because transformers divides int64 tensors, and equality decides the ties."""
    height, width = (np.float32(s) for s in image_hw)
    sizes = np.array(canvases, np.int64)
    scales = np.minimum(sizes[:, 0].astype(np.float32) / height, sizes[:, 1].astype(np.float32) / width)
    upscaling = scales[scales >= 1]
    if len(upscaling):
        chosen = upscaling.max() if resize_to_max_canvas else upscaling.min()
    else:
        chosen = scales[scales < 1].max()
    candidates = sizes[scales == chosen]
    best = candidates[np.argmin(candidates[:, 0] * candidates[:, 1])]
    return int(best[0]), int(best[1])


def resized_size(image_hw, canvas: tuple[int, int], tile: int, resize_to_max_canvas: bool) -> tuple[int, int]:
    """The size the image is resized to inside its canvas: aspect ratio kept, and unless
    resize_to_max_canvas, never upscaled past one tile (a small image fills one tile, a large
    one is only shrunk to fit).

    transformers computes this with a mix of Python ints and 0-d int64 tensors: a side limited
    by the canvas (rather than by the image or the one-tile cap) is a tensor, and its scale and
    the product that is floored are then float32, not float64. That is mirrored here, since the
    floor of a product that is integral in exact arithmetic can differ between the two."""
    limits = []
    for image_side, canvas_side in zip(image_hw, canvas, strict=True):
        if resize_to_max_canvas:
            limits.append((canvas_side, True))
        else:
            cap = max(image_side, tile)
            # Python's min(cap, tensor) returns the tensor only when it is strictly smaller.
            limits.append((canvas_side, True) if canvas_side < cap else (cap, False))
    return _fit_without_distortion(image_hw, limits)


def _fit_without_distortion(image_hw, limits) -> tuple[int, int]:
    (height, width), ((limit_h, h_f32), (limit_w, w_f32)) = image_hw, limits
    scale_w = np.float32(limit_w) / np.float32(width) if w_f32 else limit_w / width
    scale_h = np.float32(limit_h) / np.float32(height) if h_f32 else limit_h / height
    if h_f32 or w_f32:  # a comparison with a float32 tensor is made in float32
        width_limits = np.float32(scale_w) < np.float32(scale_h)
    else:
        width_limits = scale_w < scale_h
    if width_limits:
        new_h = min(math.floor(_times(height, scale_w, w_f32)), limit_h)
        new_w = limit_w
    else:
        new_h = limit_h
        new_w = min(math.floor(_times(width, scale_h, h_f32)), limit_w)
    return max(int(new_h), 1), max(int(new_w), 1)


def _times(side: int, scale, in_float32: bool):
    return np.float32(side) * np.float32(scale) if in_float32 else side * scale


# -- torch's uint8 antialiased bilinear resize ---------------------------------------------------


def resize_bilinear_uint8(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """[C, H, W] uint8 -> [C, h, w] uint8, bit-exact with torch's native uint8 kernel behind
    torchvision's resize(..., BILINEAR, antialias=True)."""
    out = image
    if size[1] != image.shape[2]:  # horizontal pass first, rounded to uint8, as torch does
        out = _resample_last_axis(out, size[1])
    if size[0] != image.shape[1]:
        out = _resample_last_axis(out.swapaxes(1, 2), size[0]).swapaxes(1, 2)
    return np.ascontiguousarray(out)


def _resample_last_axis(image: np.ndarray, out_size: int) -> np.ndarray:
    starts, weights, precision = _int16_filter_weights(image.shape[-1], out_size)
    source = image.astype(np.int32)
    # torch accumulates int16 weight x uint8 pixel products in int32 from half the final unit,
    # then shifts: integer arithmetic, so the order of the sum does not matter.
    total = np.full((*image.shape[:-1], out_size), 1 << (precision - 1), np.int32)
    last = image.shape[-1] - 1
    for k in range(weights.shape[1]):
        total += weights[:, k] * source[..., np.minimum(starts + k, last)]
    return np.clip(total >> precision, 0, 255).astype(np.uint8)


def _int16_filter_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per output index: the first input index, the int16 weights (zero past the filter's
    reach) and their fixed-point precision, computed in float64 in the same order as torch's
    `_compute_indices_int16_weights_aa` (HelperInterpLinear, antialias, align_corners=False)."""
    scale = in_size / out_size
    support = scale if scale >= 1.0 else 1.0  # the triangle widens when shrinking
    inv_scale = 1.0 / scale if scale >= 1.0 else 1.0
    width = math.ceil(support) * 2 + 1
    starts = np.zeros(out_size, np.int64)
    weights = np.zeros((out_size, width), np.float64)
    for i in range(out_size):
        center = scale * (i + 0.5)
        first = max(int(center - support + 0.5), 0)
        count = min(int(center + support + 0.5), in_size) - first
        row = [_triangle((j + first - center + 0.5) * inv_scale) for j in range(count)]
        total = 0.0
        for w in row:
            total += w
        starts[i] = first
        weights[i, :count] = [w / total for w in row] if total != 0.0 else row
    w_max = float(weights.max())
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    fixed = np.trunc(0.5 + weights * (1 << precision)).astype(np.int32)  # weights are never negative
    return starts, fixed, precision


def _triangle(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


# -- normalising and tiling ----------------------------------------------------------------------


def normalise(images: np.ndarray, settings: Llama4ImageProcessing) -> np.ndarray:
    """[..., 3, H, W] uint8 -> float32 holding the bf16 values transformers computes:
    bf16(byte) * rescale, then (x - mean) / std, each op in float32 and rounded to bf16."""
    table = _normalise_table(settings)  # [3, 256]
    return table[np.arange(3)[:, None, None], images]


def _normalise_table(settings: Llama4ImageProcessing) -> np.ndarray:
    bf16 = ml_dtypes.bfloat16
    levels = np.arange(256, dtype=np.float32).astype(bf16).astype(np.float32)
    scaled = (levels * np.float32(settings.rescale_factor)).astype(bf16).astype(np.float32)
    mean = np.asarray(settings.image_mean, np.float32).astype(bf16).astype(np.float32)[:, None]
    std = np.asarray(settings.image_std, np.float32).astype(bf16).astype(np.float32)[:, None]
    centred = (scaled[None, :] - mean).astype(bf16).astype(np.float32)
    return (centred / std).astype(bf16).astype(np.float32)


def split_into_tiles(image: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[C, rows*t, cols*t] -> [rows*cols, C, t, t], row-major: the order the prompt lists them."""
    channels, height, width = image.shape
    tiles = image.reshape(channels, rows, height // rows, cols, width // cols)
    return tiles.transpose(1, 3, 0, 2, 4).reshape(rows * cols, channels, height // rows, width // cols)


# -- prompt placeholders -------------------------------------------------------------------------

# Llama4Processor._prompt_split_image writes these strings literally (its configurable token
# attributes are not used there), so they are looked up by these names whatever the config says.
_TOKEN_TEXTS = {
    "start": "<|image_start|>",
    "end": "<|image_end|>",
    "patch": "<|patch|>",
    "tile_x_separator": "<|tile_x_separator|>",
    "tile_y_separator": "<|tile_y_separator|>",
    "image": "<|image|>",
}


@dataclasses.dataclass(frozen=True)
class ImageTokenIds:
    start: int
    end: int
    patch: int  # the token each image embedding replaces (config.image_token_index)
    tile_x_separator: int
    tile_y_separator: int
    image: int  # marks the global tile; also the single placeholder the chat template writes

    @classmethod
    def from_vocab(cls, token_id) -> ImageTokenIds:
        """`token_id(text) -> int | None`, e.g. jfire's Tokenizer.special_token_id."""
        ids = {field: token_id(text) for field, text in _TOKEN_TEXTS.items()}
        missing = [_TOKEN_TEXTS[f] for f, i in ids.items() if i is None]
        if missing:
            raise JfireError(f"the tokenizer lacks Llama 4's image tokens {', '.join(missing)}")
        return cls(**ids)


def tokens_per_tile(tile_size: int, patch_size: int, pixel_shuffle_ratio: float) -> int:
    """Patch tokens per tile after pixel shuffle: 144 for 336 / 14 / 0.5."""
    downsample = int(round(1.0 / pixel_shuffle_ratio**2))
    return (tile_size // patch_size) * (tile_size // patch_size) // downsample


def image_placeholder_ids(aspect_ratio: tuple[int, int], per_tile: int, ids: ImageTokenIds) -> list[int]:
    """The ids that replace one `<|image|>` of the chat prompt: per tile row, the tiles'
    patch tokens separated by x separators and ended by a y separator; then the global tile
    (the only one when the image is a single tile) as `<|image|>` and its patch tokens."""
    rows, cols = aspect_ratio
    out = [ids.start]
    if rows * cols > 1:
        for _ in range(rows):
            for col in range(cols):
                out += [ids.patch] * per_tile
                if col < cols - 1:
                    out.append(ids.tile_x_separator)
            out.append(ids.tile_y_separator)
    out += [ids.image] + [ids.patch] * per_tile + [ids.end]
    return out
