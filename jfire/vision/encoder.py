"""The engine's images: where each request's image rows go, their encoding before the prefill
that needs them, and the encoder cache.

A request's prompt holds each image's placeholder ids (`VisionModel.expand_prompt`); the
encoder's rows for it replace the embeddings of its `image_token_id` positions, in order. The
engine encodes an image when a prefill chunk first reaches one of those positions (the step's
new images batched into calls of at most one largest image's tiles or patches, so a call's
workspace is one largest image's, as `jfire plan` counts it), keeps the rows by the image's content hash under a byte budget
(least recently used out first), and hands each chunk its slice of rows as the prefill
program's `embeds`.

The image's hash also enters the prefix cache's block hashes (`RequestImages.extra_keys`): a
block holding any of its positions is keyed by the image as well as the ids, so the same image
again finds its pages, and another image with the same placeholder count does not.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from jfire.errors import RequestError
from jfire.vision.model import ImagePixels, VisionModel


@dataclasses.dataclass(frozen=True)
class RequestImage:
    """One image of a request: its content hash (jfire.vision.images) and its pixels."""

    content_hash: bytes
    pixels: ImagePixels

    def to_json(self) -> dict:
        """As a split deployment's frontend sends it to a prefill group: the pixels' float32
        bytes in base64 (an image's tiles or patches, a few MB: local traffic)."""
        p = self.pixels
        values = np.ascontiguousarray(p.pixel_values, np.float32)
        return {
            "hash": self.content_hash.hex(),
            "shape": list(values.shape),
            "pixels": base64.b64encode(values.tobytes()).decode(),
            "grid": list(p.grid),
            "num_tokens": p.num_tokens,
        }

    @classmethod
    def from_json(cls, body: dict) -> RequestImage:
        values = np.frombuffer(base64.b64decode(body["pixels"]), np.float32).reshape(body["shape"])
        pixels = ImagePixels(values, tuple(int(g) for g in body["grid"]), int(body["num_tokens"]))
        return cls(bytes.fromhex(body["hash"]), pixels)


@dataclasses.dataclass
class RequestImages:
    """A request's images and where their rows go in its prompt."""

    images: list[RequestImage]
    positions: np.ndarray  # int [rows]: the prompt positions taking rows, in order
    image_of_row: np.ndarray  # int [rows]: which image each row comes from
    spans: list[tuple[int, int]]  # each image's first and last-plus-one row position
    used: set[int] = dataclasses.field(default_factory=set)  # images a prefill of it has taken rows of

    def extra_keys(self, start: int, end: int) -> bytes:
        """The hashes of the images with a position in block [start, end), for its block hash."""
        return b"".join(i.content_hash for i, (a, b) in zip(self.images, self.spans) if a < end and b > start)

    def rows_in(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, row indices) of the rows in [start, end)."""
        lo, hi = np.searchsorted(self.positions, [start, end])
        return self.positions[lo:hi], np.arange(lo, hi)


def place_images(vision: VisionModel | None, prompt_ids: Sequence[int], images: Sequence[RequestImage]):
    """Where each image's rows go in this prompt (None: no images); a RequestError where they
    cannot go. `vision` None: a text-only model."""
    if not images:
        return None
    if vision is None:
        raise RequestError("this model takes no images (it has no vision encoder); send text only", param="messages")
    positions = np.flatnonzero(np.asarray(prompt_ids) == vision.image_token_id)
    counts = [i.pixels.num_tokens for i in images]
    if len(positions) != sum(counts):
        raise RequestError(
            f"the prompt holds {len(positions)} image placeholder tokens, but its {len(images)} images take "
            f"{sum(counts)}: expand the prompt with each image's placeholder ids, in order",
            param="messages",
        )
    image_of_row = np.repeat(np.arange(len(images)), counts)
    ends = np.cumsum(counts)
    spans = [(int(positions[e - n]), int(positions[e - 1]) + 1) for n, e in zip(counts, ends)]
    return RequestImages(list(images), positions, image_of_row, spans)


class ImageEncoder:
    """`vision` None: a text-only model (a request with images is refused)."""

    def __init__(self, vision: VisionModel | None, budget_bytes: int = 1 << 30):
        self.vision = vision
        self.budget_bytes = budget_bytes
        self._cache: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()  # hash -> rows
        self._cached_bytes = 0
        self.images = 0  # images received
        self.encoded = 0  # images the encoder ran on
        self.cache_hits = 0  # images a prefill took from the cache (each request's once)
        self.seconds = 0.0  # spent encoding
        self.compile_seconds = 0.0  # compiling its programs ahead of time (warm_up)

    def for_request(self, prompt_ids: Sequence[int], images: Sequence[RequestImage]) -> RequestImages | None:
        """Where each image's rows go in this prompt; a RequestError where they cannot go."""
        placed = place_images(self.vision, prompt_ids, images)
        self.images += len(images)
        return placed

    def chunk_embeds(self, chunks, rows: int, t: int, width: int):
        """The prefill call's `embeds` for chunks (jfire.scheduler.Chunk: seq, start, length):
        (values float32 [rows, t, width], mask bool [rows, t]), encoding what is missing first."""
        values = np.zeros((rows, t, width), np.float32)
        mask = np.zeros((rows, t), bool)
        placements = []  # (row, chunk, its images, row ids in the chunk, the images they come from)
        for r, c in enumerate(chunks):
            placed = c.seq.images
            if placed is not None:
                _, row_ids = placed.rows_in(c.start, c.start + c.length)
                if len(row_ids):
                    placements.append((r, c, placed, row_ids, np.unique(placed.image_of_row[row_ids])))
        self._encode_missing([(placed, int(k)) for _, _, placed, _, ks in placements for k in ks])
        for r, c, placed, row_ids, ks in placements:
            for k in ks:
                mine = row_ids[placed.image_of_row[row_ids] == k]
                first = int(np.searchsorted(placed.image_of_row, k))  # the image's first row
                encoded = self._cache[placed.images[k].content_hash]
                values[r, placed.positions[mine] - c.start] = encoded[mine - first]
            mask[r, placed.positions[row_ids] - c.start] = True
        self._evict()  # after the rows are placed: the step's own images stay until then
        return values, mask

    def _encode_missing(self, uses: list[tuple[RequestImages, int]]) -> None:
        """Makes sure the rows of each (request's images, image index) are cached: the images
        not in the cache are encoded, all in one call. Counts each request's image once."""
        missing: dict[bytes, RequestImage] = {}
        for placed, k in uses:
            image = placed.images[k]
            first_use = k not in placed.used
            placed.used.add(k)
            if image.content_hash in self._cache:
                self._cache.move_to_end(image.content_hash)
                self.cache_hits += first_use
            else:
                missing[image.content_hash] = image
        if not missing:
            return
        t0 = time.perf_counter()
        for call in self._calls(list(missing.values())):
            rows = np.asarray(self.vision.encode([i.pixels for i in call]), np.float32)  # type: ignore[union-attr]
            for image, part in zip(call, np.split(rows, np.cumsum([i.pixels.num_tokens for i in call])[:-1])):
                self._cache[image.content_hash] = part
                self._cached_bytes += part.nbytes
        self.encoded += len(missing)
        self.seconds += time.perf_counter() - t0

    def _calls(self, images: list[RequestImage]) -> list[list[RequestImage]]:
        """The images in encoder calls of at most one largest image's tiles or patches each."""
        vision = self.vision
        calls: list[list[RequestImage]] = []
        held = 0
        for image in images:
            units = vision.call_units(image.pixels)  # type: ignore[union-attr]
            if not calls or held + units > vision.call_capacity:  # type: ignore[union-attr]
                calls.append([])
                held = 0
            calls[-1].append(image)
            held += units
        return calls

    def _evict(self) -> None:
        """Down to the byte budget, the least recently used first (the last image stays)."""
        while self._cached_bytes > self.budget_bytes and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= dropped.nbytes

    def warm_up(self, stop=None) -> None:
        """Compiles the encoder's programs ahead of time, one input of each bucket, until done
        or `stop` (a threading.Event) is set; a text-only model has none."""
        if self.vision is None:
            return
        t0 = time.perf_counter()
        for example in self.vision.warm_up_examples():
            if stop is not None and stop.is_set():
                return
            np.asarray(self.vision.encode(example))
        self.compile_seconds = time.perf_counter() - t0

    def stats(self) -> dict:
        if self.vision is None:
            return {}
        return {
            "images": self.images,
            "images_encoded": self.encoded,
            "encoder_seconds": self.seconds,
            "encoder_cache_hits": self.cache_hits,
            "encoder_cache_bytes": self._cached_bytes,
        }
