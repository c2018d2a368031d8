"""Kimi K2.5's image encoder: MoonViT-3D (`vision_tower.*`) and the patch-merger projector
(`mm_projector.*`), as transformers' `Kimi_K25VisionModel` and `Kimi_K25MultimodalProjection`
compute them, for images (t = 1; video's temporal pooling is not built).

  - Patch embedding: a 14x14 stride-14 conv, i.e. one matmul over each patch flattened as
    (channel, y, x), which is how jfire.vision.kimi_k25_preprocess lays the patches out.
  - Position: a learned 64x64 grid resampled to the image's (h, w) patch grid by bicubic
    interpolation (Keys a = -0.75, half-pixel centres, taps clamped at the border: torch's
    `F.interpolate(mode="bicubic", align_corners=False)`), computed as transformers does, as
    16 gather taps and weights per patch (float32, on the host, from the grid alone).
  - Attention: axial 2-D RoPE over the whole head (pairs alternate column and row angles),
    bidirectional within each image only; pre-norm LayerNorm blocks, GELU (tanh) MLP.
  - Merge: after the final LayerNorm, each 2x2 patch group becomes one token (its four
    vectors, row-major in the group, concatenated); the projector is
    LayerNorm(per patch vector) -> Linear -> GELU (exact) -> Linear to the text width.

Output order: image by image, merged tokens row-major over the image's (h/2, w/2) grid; that is
the order the text's placeholder tokens (163605) take them in (transformers' masked_scatter).

Weights are read under their released names (`vision_tower.patch_embed.proj`,
`vision_tower.encoder.blocks.{i}.wqkv`, `mm_projector.proj.0`, ...). The release keeps q and k
with rotary pairs interleaved (dims 2i, 2i+1 of a head rotate together), and so does this code;
transformers permutes them to rotate-half on load, which gives the same attention.

Shape buckets: the jitted core (`encode_padded`) takes a padded patch count P (a bucket) and a
segment id per patch (the image it belongs to, -1 for padding); a patch attends only to its own
segment. `encode` packs the images, pads to the next bucket of `PATCH_BUCKETS` (P/4 merged
tokens come out) and slices the real tokens back, so one program serves every batch of images
whose patches fit the bucket. Attention runs over blocks of queries against all P keys, so
memory stays at heads x block x P (a batch of images pays for keys of the other images, masked).

Einsum letters: p patches, k keys, h heads, d head dim, e embed, f ffn, t taps, m merged tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# Padded patch counts the core is compiled for: powers of two, so at most 2x is padding.
PATCH_BUCKETS = tuple(2**i for i in range(8, 17))  # 256 .. 65536
BLOCK = 256  # patches per step of attention and of the position gather; divides every bucket


@dataclasses.dataclass(frozen=True)
class KimiK25VisionConfig:
    patch_size: int = 14
    hidden_size: int = 1152
    num_heads: int = 16
    num_layers: int = 27
    intermediate_size: int = 4304
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    merge_size: int = 2  # the 2x2 merge kernel
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"
    text_hidden_size: int = 7168
    projector_eps: float = 1e-5
    image_token_id: int = 163605

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> KimiK25VisionConfig:
        """From a Kimi K2.5 config.json: the release's (`vt_*` names, remote code) or
        transformers' (`Kimi_K25Config`: `hidden_size`, `pos_emb_height`, ...)."""
        v = hf_config["vision_config"]
        text = hf_config.get("text_config") or {}

        def pick(*names, default=None):
            for name in names:
                if v.get(name) is not None:
                    return v[name]
            if default is None:
                raise KeyError(names[0])
            return default

        merge = pick("merge_kernel_size", default=(2, 2))
        merge = tuple(merge) if isinstance(merge, (list, tuple)) else (int(merge), int(merge))
        if merge[0] != merge[1]:
            raise ValueError(f"only a square merge kernel is built, got {merge}")
        _check_built(v)
        rope = v.get("rope_parameters") or {}
        hidden = int(pick("vt_hidden_size", "hidden_size"))
        projector_in = hf_config.get("projection_hidden_size") or v.get("mm_hidden_size") or hidden
        if int(projector_in) != hidden:
            raise ValueError(f"projector width {projector_in} differs from the vision width {hidden}")
        return cls(
            patch_size=int(pick("patch_size", default=14)),
            hidden_size=hidden,
            num_heads=int(pick("vt_num_attention_heads", "num_attention_heads")),
            num_layers=int(pick("vt_num_hidden_layers", "num_hidden_layers")),
            intermediate_size=int(pick("vt_intermediate_size", "intermediate_size")),
            pos_emb_height=int(pick("init_pos_emb_height", "pos_emb_height", default=64)),
            pos_emb_width=int(pick("init_pos_emb_width", "pos_emb_width", default=64)),
            merge_size=merge[0],
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
            hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
            text_hidden_size=int(v.get("text_hidden_size") or text["hidden_size"]),
            projector_eps=float(hf_config.get("projection_layer_norm_eps", v.get("projector_ln_eps", 1e-5))),
            image_token_id=int(hf_config.get("media_placeholder_token_id", hf_config.get("image_token_id", 163605))),
        )


# What the release's remote code can also be configured to, and this file does not build (Kimi K3's
# MoonViT-V2, for one, names its config the same way but differs in these).
_BUILT = {
    "mm_projector_type": "patchmerger",
    "projector_hidden_act": "gelu",
    "merge_type": "sd2_tpool",
    "pos_emb_type": "divided_fixed",
    "pos_emb_interpolation_mode": "bicubic",
    "norm_type": "layernorm",
}


def _check_built(vision_config: Mapping[str, Any]) -> None:
    for key, built in _BUILT.items():
        if vision_config.get(key, built) != built:
            raise ValueError(f"vision_config {key}={vision_config[key]!r} is not built (only {built!r})")
    if vision_config.get("qkv_hidden_size") not in (None, vision_config.get("vt_hidden_size")):
        raise ValueError("a qkv width other than the hidden width is not built")


# ---------------------------------------------------------------------------------------------
# Loading: released tensor names -> params pytree


def _layer_tensors(i: int) -> dict[str, str]:
    b = f"vision_tower.encoder.blocks.{i}."
    return {
        "norm1_scale": b + "norm0.weight",
        "norm1_bias": b + "norm0.bias",
        "qkv_kernel": b + "wqkv.weight",
        "qkv_bias": b + "wqkv.bias",
        "out_kernel": b + "wo.weight",
        "out_bias": b + "wo.bias",
        "norm2_scale": b + "norm1.weight",
        "norm2_bias": b + "norm1.bias",
        "fc1_kernel": b + "mlp.fc0.weight",
        "fc1_bias": b + "mlp.fc0.bias",
        "fc2_kernel": b + "mlp.fc1.weight",
        "fc2_bias": b + "mlp.fc1.bias",
    }


_TOP_TENSORS = {
    ("patch_embed", "kernel"): "vision_tower.patch_embed.proj.weight",
    ("patch_embed", "bias"): "vision_tower.patch_embed.proj.bias",
    ("pos_emb",): "vision_tower.patch_embed.pos_emb.weight",
    ("final_norm", "scale"): "vision_tower.encoder.final_layernorm.weight",
    ("final_norm", "bias"): "vision_tower.encoder.final_layernorm.bias",
    ("projector", "norm_scale"): "mm_projector.pre_norm.weight",
    ("projector", "norm_bias"): "mm_projector.pre_norm.bias",
    ("projector", "in_kernel"): "mm_projector.proj.0.weight",
    ("projector", "in_bias"): "mm_projector.proj.0.bias",
    ("projector", "out_kernel"): "mm_projector.proj.2.weight",
    ("projector", "out_bias"): "mm_projector.proj.2.bias",
}

# transformers 5.x's save_pretrained writes two of the released names back differently (its
# reverse rename is not the inverse of its load rename); accepted so its files load too.
_ALSO_WRITTEN_AS = {
    "vision_tower.patch_embed.": "vision_tower.encoder.patch_embed.",
    "mm_projector.pre_norm.": "model.mm_projector.pre_norm.",
}

_SAFETENSORS_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}


class _SafetensorsDir:
    """Tensors of an HF directory's *.safetensors files, memory-mapped by name."""

    def __init__(self, path: Path):
        self.where: dict[str, tuple[Path, dict, int]] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    self.where[name] = (file, info, 8 + size)

    def get(self, name: str) -> np.ndarray:
        candidates = [name] + [name.replace(a, b, 1) for a, b in _ALSO_WRITTEN_AS.items() if name.startswith(a)]
        for candidate in candidates:
            if candidate in self.where:
                file, info, data_start = self.where[candidate]
                start, end = info["data_offsets"]
                raw = np.memmap(file, dtype=np.uint8, mode="r", offset=data_start + start, shape=(end - start,))
                return raw.view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
        raise KeyError(f"tensor {name!r} is not in the checkpoint")


def _to_param(path: tuple[str, ...], w: np.ndarray) -> np.ndarray:
    """Released layout -> the layout `encode_padded` multiplies with (inputs on the left)."""
    w = np.asarray(w, np.float32)
    if path == ("patch_embed", "kernel"):  # conv [E, 3, p, p] -> [3 * p * p, E]
        return w.reshape(w.shape[0], -1).T
    if path == ("pos_emb",):  # [H, W, E] -> [H * W, E], the taps index it flat
        return w.reshape(-1, w.shape[-1])
    if path[-1].endswith("kernel"):  # torch Linear [out, in] -> [in, out]
        return w.T
    return w


def param_shapes(cfg: KimiK25VisionConfig) -> dict:
    """The params pytree's shapes (layers stacked on a leading axis), as `encode_padded` takes them."""
    e, f, n, t = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.text_hidden_size
    merged = e * cfg.merge_size**2
    return {
        "patch_embed": {"kernel": (3 * cfg.patch_size**2, e), "bias": (e,)},
        "pos_emb": (cfg.pos_emb_height * cfg.pos_emb_width, e),
        "final_norm": {"scale": (e,), "bias": (e,)},
        "projector": {
            "norm_scale": (e,),
            "norm_bias": (e,),
            "in_kernel": (merged, merged),
            "in_bias": (merged,),
            "out_kernel": (merged, t),
            "out_bias": (t,),
        },
        "layers": {
            "norm1_scale": (n, e),
            "norm1_bias": (n, e),
            "qkv_kernel": (n, e, 3 * e),
            "qkv_bias": (n, 3 * e),
            "out_kernel": (n, e, e),
            "out_bias": (n, e),
            "norm2_scale": (n, e),
            "norm2_bias": (n, e),
            "fc1_kernel": (n, e, f),
            "fc1_bias": (n, f),
            "fc2_kernel": (n, f, e),
            "fc2_bias": (n, e),
        },
    }


def load_params(path: str | Path, cfg: KimiK25VisionConfig, dtype=jnp.float32) -> dict:
    """The encoder's params (numpy, `dtype`) from an HF safetensors directory."""
    source = _SafetensorsDir(Path(path))
    np_dtype = np.dtype(dtype)
    params: dict = {}
    for tree_path, name in _TOP_TENSORS.items():
        node = params
        for key in tree_path[:-1]:
            node = node.setdefault(key, {})
        node[tree_path[-1]] = _to_param(tree_path, source.get(name)).astype(np_dtype)
    per_layer = [_layer_tensors(i) for i in range(cfg.num_layers)]
    params["layers"] = {
        key: np.stack([_to_param((key,), source.get(names[key])) for names in per_layer]).astype(np_dtype)
        for key in per_layer[0]
    }
    expected = param_shapes(cfg)
    for (where, array), shape in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(expected, is_leaf=lambda x: isinstance(x, tuple))
    ):
        if array.shape != shape:
            raise ValueError(f"{path}: {jax.tree_util.keystr(where)} has shape {array.shape}, the config says {shape}")
    return params


# ---------------------------------------------------------------------------------------------
# Host-side packing: everything the core needs that depends only on the grids


class PackedImages(NamedTuple):
    patches: np.ndarray  # [P, 3 * p * p] pixels, padding rows zero
    segment: np.ndarray  # [P] int32: the image each patch belongs to, -1 for padding
    rope_pos: np.ndarray  # [P, 2] int32: (row, col) of each patch in its image's grid
    pos_taps: np.ndarray  # [P, 16] int32: rows of the flat learned position table
    pos_weights: np.ndarray  # [P, 16] float32: bicubic weights of those rows
    merge_index: np.ndarray  # [P / 4, 4] int32: the patches of each merged token
    num_tokens: int  # merged tokens that are real (the rest are padding)


def _bicubic_axis(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """4 taps into a `side`-long axis and their weights for target positions `index` of a
    `size`-long axis: transformers' `_interpolation_axis_taps_weights`, float32 as it computes."""
    f32 = np.float32
    src = (index.astype(f32) + f32(0.5)) * f32(side) / f32(size) - f32(0.5)
    floor = np.floor(src)
    offsets = np.arange(-1, 3)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(f32))
    a = f32(-0.75)
    near = ((a + f32(2)) * distance - (a + f32(3))) * distance * distance + f32(1)
    far = ((a * distance - f32(5) * a) * distance + f32(8) * a) * distance - f32(4) * a
    return taps, np.where(distance <= 1, near, far).astype(f32)


def position_taps(h: int, w: int, cfg: KimiK25VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """([h * w, 16] rows of the flat position table, [h * w, 16] weights), raster order."""
    rows, cols = np.divmod(np.arange(h * w), w)
    # transformers resamples along both axes with the table's height as the side (it is square).
    side = cfg.pos_emb_height
    row_taps, row_w = _bicubic_axis(rows, h, side)
    col_taps, col_w = _bicubic_axis(cols, w, side)
    taps = (row_taps[:, :, None] * cfg.pos_emb_width + col_taps[:, None, :]).reshape(-1, 16)
    weights = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 16)
    return taps.astype(np.int32), weights


def merge_index(h: int, w: int, merge: int) -> np.ndarray:
    """[h * w / merge**2, merge**2]: each merged token's patches, tokens row-major over the
    merged grid, patches row-major within the group."""
    r, c = np.meshgrid(np.arange(h // merge), np.arange(w // merge), indexing="ij")
    dy, dx = np.divmod(np.arange(merge * merge), merge)
    rows = r.reshape(-1, 1) * merge + dy
    cols = c.reshape(-1, 1) * merge + dx
    return (rows * w + cols).astype(np.int32)


def patch_bucket(num_patches: int, buckets: Sequence[int] = PATCH_BUCKETS) -> int:
    """The smallest bucket holding `num_patches`; past the largest, a multiple of it."""
    for bucket in buckets:
        if bucket >= num_patches:
            return bucket
    largest = buckets[-1]
    return -(-num_patches // largest) * largest


def pack(
    pixel_values: np.ndarray, grids: np.ndarray, cfg: KimiK25VisionConfig, bucket: int | None = None
) -> PackedImages:
    """Images' patches ([total, 3, p, p] or [total, 3 * p * p]) and grids ([n, 3] (t, h, w))
    laid out for `encode_padded`, padded to `bucket` patches (default: `patch_bucket`)."""
    grids = np.asarray(grids, np.int64)
    if (grids[:, 0] != 1).any():
        raise ValueError("only images (t = 1) are built; video grids have t > 1")
    if (grids[:, 1:] % cfg.merge_size).any():
        raise ValueError(
            f"grids must be multiples of the {cfg.merge_size}x{cfg.merge_size} merge, got {grids.tolist()}"
        )
    counts = grids[:, 1] * grids[:, 2]
    total = int(counts.sum())
    flat = np.asarray(pixel_values).reshape(total, -1)
    size = patch_bucket(total) if bucket is None else bucket
    if size < total or size % (cfg.merge_size**2) or size % min(BLOCK, size):
        raise ValueError(f"bucket {size} cannot hold {total} patches in whole merge groups and {BLOCK}-patch blocks")
    patches = np.zeros((size, flat.shape[1]), flat.dtype)
    patches[:total] = flat
    segment = np.full(size, -1, np.int32)
    rope_pos = np.zeros((size, 2), np.int32)
    taps = np.zeros((size, 16), np.int32)
    weights = np.zeros((size, 16), np.float32)
    merged = np.zeros((size // cfg.merge_size**2, cfg.merge_size**2), np.int32)
    start = start_token = 0
    for image, (_, h, w) in enumerate(grids.tolist()):
        n = h * w
        segment[start : start + n] = image
        rope_pos[start : start + n] = np.stack(np.divmod(np.arange(n), w), axis=-1)
        taps[start : start + n], weights[start : start + n] = position_taps(h, w, cfg)
        index = merge_index(h, w, cfg.merge_size) + start
        merged[start_token : start_token + len(index)] = index
        start, start_token = start + n, start_token + len(index)
    return PackedImages(patches, segment, rope_pos, taps, weights, merged, start_token)


# ---------------------------------------------------------------------------------------------
# The jitted core


def _position_embedding(table, taps, weights):
    """[P, e] float32: the weighted taps of the flat position table, a block of patches at a
    time so the gathered rows held at once are [block, 16, e], not [P, 16, e]."""
    size = taps.shape[0]
    block = min(BLOCK, size)

    def one_block(args):
        block_taps, block_weights = args
        return jnp.einsum("pt,pte->pe", block_weights, table[block_taps].astype(jnp.float32))

    out = jax.lax.map(one_block, (taps.reshape(-1, block, taps.shape[1]), weights.reshape(-1, block, weights.shape[1])))
    return out.reshape(size, table.shape[1])


def _layer_norm(x, scale, bias, eps):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _rope_angles(rope_pos, cfg: KimiK25VisionConfig):
    """[P, head_dim / 2] angles: pair 2j turns with the column, pair 2j + 1 with the row."""
    quarter = cfg.head_dim // 4
    exponents = np.arange(0, 2 * quarter, 2, dtype=np.float32) / np.float32(2 * quarter)
    inv_freq = jnp.asarray(np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponents))  # [head_dim / 4]
    rows = rope_pos[:, 0:1].astype(jnp.float32) * inv_freq
    cols = rope_pos[:, 1:2].astype(jnp.float32) * inv_freq
    return jnp.stack([cols, rows], axis=-1).reshape(rope_pos.shape[0], 2 * quarter)


def _apply_rope(x, angles):
    """x [P, h, d] with rotary pairs interleaved (the release's layout), in float32."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    a, b = pairs[..., 0], pairs[..., 1]
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape).astype(x.dtype)


def _segment_attention(q, k, v, segment, scale):
    """Bidirectional attention within each segment: q, k, v [P, h, d]; blocks of queries
    against every key, so the logits held at once are [h, block, P]."""
    size, heads, dim = q.shape
    block = min(BLOCK, size)

    def one_block(args):
        q_block, seg_block = args  # [B, h, d], [B]
        logits = jnp.einsum("phd,khd->hpk", q_block, k, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(seg_block[None, :, None] == segment[None, None, :], logits, -jnp.inf)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.einsum("hpk,khd->phd", probs, v)

    out = jax.lax.map(one_block, (q.reshape(size // block, block, heads, dim), segment.reshape(-1, block)))
    return out.reshape(size, heads, dim)


def _encoder_layer(cfg: KimiK25VisionConfig, x, layer, angles, segment):
    size, e = x.shape
    h = _layer_norm(x, layer["norm1_scale"], layer["norm1_bias"], 1e-5)
    qkv = (h @ layer["qkv_kernel"] + layer["qkv_bias"]).reshape(size, 3, cfg.num_heads, cfg.head_dim)
    q, k = _apply_rope(qkv[:, 0], angles), _apply_rope(qkv[:, 1], angles)
    attn = _segment_attention(q, k, qkv[:, 2], segment, cfg.head_dim**-0.5).reshape(size, e)
    x = x + attn @ layer["out_kernel"] + layer["out_bias"]
    h = _layer_norm(x, layer["norm2_scale"], layer["norm2_bias"], 1e-5)
    h = h @ layer["fc1_kernel"] + layer["fc1_bias"]
    h = jax.nn.gelu(h, approximate=cfg.hidden_act in ("gelu_pytorch_tanh", "gelu_new"))
    return x + h @ layer["fc2_kernel"] + layer["fc2_bias"]


def _project(cfg: KimiK25VisionConfig, merged, p):
    """[m, 4, e] merged patch groups -> [m, text width]."""
    x = _layer_norm(merged, p["norm_scale"], p["norm_bias"], cfg.projector_eps).reshape(merged.shape[0], -1)
    x = jax.nn.gelu(x @ p["in_kernel"] + p["in_bias"], approximate=False)
    return x @ p["out_kernel"] + p["out_bias"]


@partial(jax.jit, static_argnums=1)
def encode_padded(params, cfg: KimiK25VisionConfig, patches, segment, rope_pos, pos_taps, pos_weights, merge_idx):
    """The compiled core over one bucket: PackedImages' arrays -> [P / 4, text width], rows
    past PackedImages.num_tokens being padding."""
    dtype = params["pos_emb"].dtype
    with jax.named_scope("patch_embed"):
        x = patches.astype(dtype) @ params["patch_embed"]["kernel"] + params["patch_embed"]["bias"]
        x = x + _position_embedding(params["pos_emb"], pos_taps, pos_weights).astype(dtype)
    angles = _rope_angles(rope_pos, cfg)

    def layer_step(x, layer):
        with jax.named_scope("encoder_layer"):
            return _encoder_layer(cfg, x, layer, angles, segment), None

    x, _ = jax.lax.scan(layer_step, x, params["layers"])
    x = _layer_norm(x, params["final_norm"]["scale"], params["final_norm"]["bias"], 1e-5)
    with jax.named_scope("projector"):
        return _project(cfg, x[merge_idx], params["projector"])


def encode(
    params,
    cfg: KimiK25VisionConfig,
    pixel_values: np.ndarray,
    grids: np.ndarray,
    buckets: Sequence[int] = PATCH_BUCKETS,
) -> jax.Array:
    """Images' patches and grids (as jfire.vision.kimi_k25_preprocess.preprocess returns them)
    -> [total merged tokens, text width], in the order they replace the placeholder tokens."""
    counts = np.asarray(grids)[:, 1:].prod(-1)
    packed = pack(pixel_values, grids, cfg, patch_bucket(int(counts.sum()), buckets))
    out = encode_padded(params, cfg, *(jnp.asarray(a) for a in packed[:-1]))
    return out[: packed.num_tokens]
