"""The image side of a multimodal model, as the engine sees it: one object per model directory.

`load_vision_model(path)` reads a Hugging Face directory beside the text model (which
jfire.models reads from the same directory, skipping the vision tensors) and returns a
`VisionModel`, or None for a text-only model. Whichever family it is, the engine uses it the
same way:

  1. `preprocess(image)` -> `ImagePixels`, on the host (numpy, Pillow);
  2. the chat template writes one placeholder token per image (`template_token_id`);
     `expand_prompt(ids, images)` puts each image's `placeholder_ids` in its place, the ids
     transformers' processor expands it to;
  3. `encode(images)` -> [tokens, text width]: one row per `image_token_id` in the expanded
     prompt, in order (the rows transformers' masked_scatter writes);
  4. `prompt_embeds(ids, rows)` -> (values [t, e], mask [t]) aligned with the prompt: a
     prefill chunk passes its slice as the decoder's `embeds`, and those positions take the
     image's rows in place of their token embeddings.

Llama 4 (`Llama4ForConditionalGeneration`): tiles of 336 pixels, 144 `<|patch|>` tokens each,
framed by `<|image_start|>`, tile separators, `<|image|>` before the global tile and
`<|image_end|>`; the chat template writes `<|image|>` once per image. Kimi K2.5
(`Kimi_K25ForConditionalGeneration`, released as `KimiK25ForConditionalGeneration`): one
`<|media_pad|>` per merged 2x2 patch group; the chat template writes
`<|media_begin|>image<|media_content|><|media_pad|><|media_end|>` and only the pad is repeated.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from jfire.errors import JfireError
from jfire.tokenizer import Tokenizer
from jfire.vision import kimi_k25, kimi_k25_preprocess, llama4, llama4_preprocess


@dataclasses.dataclass(frozen=True)
class ImagePixels:
    """One preprocessed image: what its model's encoder takes, and what its prompt needs."""

    pixel_values: np.ndarray  # float32; Llama 4: [tiles, 3, tile, tile]; Kimi K2.5: [patches, 3, 14, 14]
    grid: tuple[int, ...]  # Llama 4: (tile rows, tile columns); Kimi K2.5: (t, h, w) in patches
    num_tokens: int  # the encoder's rows for it: its `image_token_id` positions in the prompt


class VisionModel:
    """What every multimodal family provides (see the module's docstring)."""

    family: ClassVar[str]

    @property
    def image_token_id(self) -> int:
        """The prompt positions whose embeddings the encoder's rows replace."""
        raise NotImplementedError

    @property
    def template_token_id(self) -> int:
        """The token the chat template writes once per image."""
        raise NotImplementedError

    def preprocess(self, image: Image.Image) -> ImagePixels:
        raise NotImplementedError

    def placeholder_ids(self, pixels: ImagePixels) -> list[int]:
        """The ids that replace the image's one `template_token_id` in the prompt."""
        raise NotImplementedError

    def encode(self, images: ImagePixels | Sequence[ImagePixels]) -> jax.Array:
        """[sum of num_tokens, text width]: the images' rows, in prompt order."""
        raise NotImplementedError

    def warm_up_examples(self) -> list[list[ImagePixels]]:
        """One `encode` input for each of its programs (buckets) to compile ahead of time."""
        raise NotImplementedError

    def call_units(self, pixels: ImagePixels) -> int:
        """What an image adds to an encoder call (tiles, patches): calls hold at most
        `call_capacity` of them, a largest image's, so one call's workspace is bounded by one
        largest image's (what `jfire plan` counts); a larger image runs alone."""
        return len(pixels.pixel_values)

    @property
    def call_capacity(self) -> int:
        raise NotImplementedError

    def expand_prompt(self, ids: Sequence[int], images: Sequence[ImagePixels]) -> list[int]:
        """`ids` (the chat template's, one `template_token_id` per image) with each image's
        placeholder ids in place of its template token, images taken in order."""
        slots = sum(1 for i in ids if i == self.template_token_id)
        if slots != len(images):
            raise JfireError(f"the prompt has {slots} image placeholders for {len(images)} images")
        pending = iter(images)
        out: list[int] = []
        for token in ids:
            out += self.placeholder_ids(next(pending)) if token == self.template_token_id else [int(token)]
        return out

    def prompt_embeds(self, ids: Sequence[int], rows) -> tuple[np.ndarray, np.ndarray]:
        """(values [t, e], mask [t] bool) for an expanded prompt `ids` and the `encode` rows
        of its images: row k at the k-th `image_token_id` position, zeros elsewhere."""
        mask = np.asarray(ids) == self.image_token_id
        rows = np.asarray(rows)
        if int(mask.sum()) != rows.shape[0]:
            raise JfireError(f"the prompt has {int(mask.sum())} image token positions for {rows.shape[0]} image rows")
        values = np.zeros((mask.shape[0], rows.shape[1]), rows.dtype)
        values[mask] = rows
        return values, mask


# Llama 4's tiles an encoder call pads to: one image has 1 tile, or a canvas of 2..16 and the
# global one; a call holds at most 17 (VisionModel.call_capacity).
TILE_BUCKETS = (1, 3, 5, 9, 17)


def _tile_bucket(n: int) -> int:
    return next((b for b in TILE_BUCKETS if b >= n), -(-n // TILE_BUCKETS[-1]) * TILE_BUCKETS[-1])


def _as_list(images: ImagePixels | Sequence[ImagePixels]) -> list[ImagePixels]:
    return [images] if isinstance(images, ImagePixels) else list(images)


@dataclasses.dataclass(frozen=True, eq=False)
class Llama4Vision(VisionModel):
    family: ClassVar[str] = "llama4"

    config: llama4.Llama4VisionConfig
    params: dict
    processing: llama4_preprocess.Llama4ImageProcessing
    token_ids: llama4_preprocess.ImageTokenIds

    @property
    def image_token_id(self) -> int:
        return self.token_ids.patch

    @property
    def template_token_id(self) -> int:
        return self.token_ids.image

    def preprocess(self, image: Image.Image) -> ImagePixels:
        done = llama4_preprocess.preprocess(image, self.processing)
        tokens = done.pixel_values.shape[0] * self.config.tokens_per_tile
        return ImagePixels(done.pixel_values, tuple(done.aspect_ratio), tokens)

    def placeholder_ids(self, pixels: ImagePixels) -> list[int]:
        rows, cols = pixels.grid
        return llama4_preprocess.image_placeholder_ids((rows, cols), self.config.tokens_per_tile, self.token_ids)

    def encode(self, images: ImagePixels | Sequence[ImagePixels]) -> jax.Array:
        # Padded to a bucket of tiles (each tile is encoded on its own, so the padding's rows are
        # dropped unseen): few programs for any mix of images, compiled ahead of time.
        tiles = np.concatenate([p.pixel_values for p in _as_list(images)])
        n = len(tiles)
        padded = np.zeros((_tile_bucket(n), *tiles.shape[1:]), tiles.dtype)
        padded[:n] = tiles
        return llama4.encode(self.params, self.config, jnp.asarray(padded))[: n * self.config.tokens_per_tile]

    @property
    def call_capacity(self) -> int:
        return self.processing.max_tiles + 1  # the canvas's tiles and the global one

    def warm_up_examples(self) -> list[list[ImagePixels]]:
        """An input of each tile bucket."""
        size = self.config.image_size
        out = []
        for n in TILE_BUCKETS:
            pixels = np.zeros((n, 3, size, size), np.float32)
            out.append([ImagePixels(pixels, (1, n), n * self.config.tokens_per_tile)])
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class KimiK25Vision(VisionModel):
    family: ClassVar[str] = "kimi_k25"

    config: kimi_k25.KimiK25VisionConfig
    params: dict
    processing: kimi_k25_preprocess.PreprocessConfig

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def template_token_id(self) -> int:
        return self.config.image_token_id  # the template's one pad, repeated in place

    def preprocess(self, image: Image.Image) -> ImagePixels:
        patches, grid = kimi_k25_preprocess.preprocess_one(image, self.processing)
        t, h, w = grid
        return ImagePixels(patches, tuple(grid), t * h * w // self.processing.merge_size**2)

    def placeholder_ids(self, pixels: ImagePixels) -> list[int]:
        return [self.image_token_id] * pixels.num_tokens

    def encode(self, images: ImagePixels | Sequence[ImagePixels]) -> jax.Array:
        images = _as_list(images)
        patches = np.concatenate([p.pixel_values for p in images])
        grids = np.asarray([p.grid for p in images], np.int64)
        return kimi_k25.encode(self.params, self.config, patches, grids)

    @property
    def call_capacity(self) -> int:
        return self.processing.max_patches

    def warm_up_examples(self) -> list[list[ImagePixels]]:
        """An input of each patch bucket up to the largest image's, padded (under twice the limit)."""
        p, m = self.config.patch_size, self.processing.merge_size
        out = []
        for bucket in kimi_k25.PATCH_BUCKETS:
            if bucket > kimi_k25.patch_bucket(2 * self.processing.max_patches):  # padding to whole merges
                break
            grid = (1, bucket // 16, 16)  # whole merges, filling the bucket
            count = bucket
            out.append([ImagePixels(np.zeros((count, 3, p, p), np.float32), grid, count // m**2)])
        return out


# -- loading -------------------------------------------------------------------------------------


def load_vision_model(
    path, dtype=jnp.float32, tokenizer: Tokenizer | None = None, *, weights: bool = True
) -> VisionModel | None:
    """The vision side of the HF directory `path`, its weights cast to `dtype` and placed on
    the default device; None when the model has none (a text-only model, or a jfire
    checkpoint, whose conversion keeps the text model alone). Llama 4's prompt ids come from
    its tokenizer: `tokenizer`, else the directory's own. `weights=False`: preprocessing and
    placeholders only, no encoder (a split deployment's frontend: its prefill groups encode)."""
    path = Path(path)
    config = read_json(path / "config.json")
    family = vision_family(config)
    if family == "llama4":
        return _load_llama4(path, config, dtype, tokenizer, weights)
    if family == "kimi_k25":
        return _load_kimi_k25(path, config, dtype, weights)
    return None


def vision_family(config: dict) -> str | None:
    """Which vision tower a model's config.json declares ("llama4", "kimi_k25"), or None: the
    one choice the engine (`load_vision_model`) and `jfire plan` both make."""
    if config.get("vision_config") and config.get("model_type") in ("llama4", "kimi_k25"):
        return config["model_type"]
    return None


def llama4_processing(path: Path, cfg: llama4.Llama4VisionConfig) -> llama4_preprocess.Llama4ImageProcessing:
    """Llama 4's processor settings in directory `path` (preprocessor_config.json): its defaults
    where the file is absent, but for the tile size, the tower's."""
    settings = read_json(path / "preprocessor_config.json")
    settings.setdefault("size", {"height": cfg.image_size, "width": cfg.image_size})
    return llama4_preprocess.Llama4ImageProcessing.from_hf(settings)


def _load_llama4(path: Path, config: dict, dtype, tokenizer: Tokenizer | None, weights: bool) -> Llama4Vision:
    cfg = llama4.Llama4VisionConfig.from_hf(config["vision_config"], int(config["text_config"]["hidden_size"]))
    processing = llama4_processing(path, cfg)
    if processing.tile_size != cfg.image_size:
        raise JfireError(
            f"{path}: the image processor makes {processing.tile_size}-pixel tiles, the vision tower takes {cfg.image_size}"
        )
    tokenizer = tokenizer or Tokenizer.from_dir(path)
    if tokenizer is None:
        raise JfireError(f"{path}: Llama 4's image prompts need its tokenizer, and the directory has none")
    token_ids = llama4_preprocess.ImageTokenIds.from_vocab(tokenizer.special_token_id)
    _check_same_ids(
        path,
        {
            "image_token_index": (config.get("image_token_index", config.get("image_token_id")), token_ids.patch),
            "boi_token_index": (config.get("boi_token_index"), token_ids.start),
            "eoi_token_index": (config.get("eoi_token_index"), token_ids.end),
        },
    )
    params = llama4.load_params(path, cfg, dtype) if weights else {}
    return Llama4Vision(cfg, params, processing, token_ids)


def _check_same_ids(path: Path, pairs: dict[str, tuple[Any, int]]) -> None:
    """The config's ids and the tokenizer's must agree: the model scatters at the config's."""
    wrong = [f"{key} {c} but the tokenizer's is {t}" for key, (c, t) in pairs.items() if c is not None and int(c) != t]
    if wrong:
        raise JfireError(f"{path}: config.json has " + "; ".join(wrong))


def _load_kimi_k25(path: Path, config: dict, dtype, weights: bool) -> KimiK25Vision:
    cfg = kimi_k25.KimiK25VisionConfig.from_hf(config)
    processing = kimi_k25_preprocess.PreprocessConfig.from_hf(read_json(path / "preprocessor_config.json"))
    if (processing.patch_size, processing.merge_size) != (cfg.patch_size, cfg.merge_size):
        raise JfireError(
            f"{path}: the image processor's patches ({processing.patch_size}, merged {processing.merge_size}x) "
            f"differ from the vision tower's ({cfg.patch_size}, merged {cfg.merge_size}x)"
        )
    params = jax.device_put(kimi_k25.load_params(path, cfg, dtype)) if weights else {}
    return KimiK25Vision(cfg, params, processing)


def read_json(path: Path) -> dict:
    """A JSON file's object; {} when there is no such file (the processors' defaults apply)."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise JfireError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise JfireError(f"{path} must hold a JSON object")
    return value
