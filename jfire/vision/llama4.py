"""Llama 4's vision tower and multimodal projector (transformers' Llama4VisionModel and
Llama4MultiModalProjector), as pure JAX functions of a params pytree.

Per 336x336 tile: 14x14 patches unfolded and embedded by one linear map, a CLS token appended
*after* the 576 patches, a learned position embedding, a pre-norm; 34 pre-norm encoder layers
with biased attention under 2-D RoPE (the CLS token unrotated) and a GELU MLP; a post-norm; the
CLS token dropped; a 0.5 pixel shuffle (24x24 patches -> 12x12 tokens of 4x the width); the
adapter MLP (GELU after both linears); the projector to the text width. Each tile gives 144
embeddings, which replace the prompt's `<|patch|>` tokens in order (the tiles row-major, the
global tile last), as `masked_scatter` does in Llama4ForConditionalGeneration.forward.

Einsum letters: B tiles, S tokens of a tile (patches + CLS), D vision width, H heads, K head
dim, F encoder MLP width, T tokens per tile after the shuffle, E text width.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jfire.checkpoint.paths import WEIGHT_INDEX, read_weight_map
from jfire.errors import JfireError

# transformers builds every vision LayerNorm as nn.LayerNorm(hidden_size): its default eps,
# whatever the config's norm_eps says.
LAYER_NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Llama4VisionConfig:
    hidden_size: int  # D
    num_layers: int
    num_heads: int  # H
    intermediate_size: int  # F; also the shuffled width the adapter takes (4 * D)
    image_size: int  # tile side in pixels
    patch_size: int
    num_channels: int
    pixel_shuffle_ratio: float
    projector_input_dim: int
    projector_output_dim: int
    vision_output_dim: int  # the projector's input width
    rope_theta: float
    text_hidden_size: int  # E

    @classmethod
    def from_hf(cls, vision_config: dict, text_hidden_size: int) -> Llama4VisionConfig:
        rope = vision_config.get("rope_parameters") or {}
        cfg = cls(
            hidden_size=vision_config["hidden_size"],
            num_layers=vision_config["num_hidden_layers"],
            num_heads=vision_config["num_attention_heads"],
            intermediate_size=vision_config["intermediate_size"],
            image_size=vision_config["image_size"],
            patch_size=vision_config["patch_size"],
            num_channels=vision_config.get("num_channels", 3),
            pixel_shuffle_ratio=vision_config.get("pixel_shuffle_ratio", 0.5),
            projector_input_dim=vision_config["projector_input_dim"],
            projector_output_dim=vision_config["projector_output_dim"],
            vision_output_dim=vision_config["vision_output_dim"],
            # Released configs (transformers 4.51) carry rope_theta; transformers 5 saves rope_parameters.
            rope_theta=float(rope.get("rope_theta", vision_config.get("rope_theta", 10000.0))),
            text_hidden_size=text_hidden_size,
        )
        cfg.check()
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return int((self.patches_per_side * self.pixel_shuffle_ratio) ** 2)

    def check(self) -> None:
        """The shapes transformers' modules silently assume fit together."""
        shuffled = int(self.hidden_size / self.pixel_shuffle_ratio**2)
        problems = []
        if self.head_dim % 4:
            problems.append(f"head dim {self.head_dim} is not a multiple of 4 (2-D RoPE rotates x and y pairs)")
        if self.intermediate_size != shuffled:
            problems.append(f"intermediate_size {self.intermediate_size} != the shuffled width {shuffled}")
        if self.projector_input_dim != self.projector_output_dim:
            problems.append("the adapter's second linear needs projector_input_dim == projector_output_dim")
        if self.vision_output_dim != self.projector_output_dim:
            problems.append("the projector takes vision_output_dim, which must equal projector_output_dim")
        if problems:
            raise JfireError("unsupported Llama 4 vision config: " + "; ".join(problems))


# -- parameters ----------------------------------------------------------------------------------

# (path in the params tree, HF name, per layer, HF linear stored [out, in] to transpose)
_V, _L = "vision_model.", "vision_model.model.layers.{i}."
PARAM_TABLE: tuple[tuple[str, str, bool, bool], ...] = (
    ("patch_embed", _V + "patch_embedding.linear.weight", False, True),
    ("class_embedding", _V + "class_embedding", False, False),
    ("position_embedding", _V + "positional_embedding_vlm", False, False),
    ("pre_norm.scale", _V + "layernorm_pre.weight", False, False),
    ("pre_norm.bias", _V + "layernorm_pre.bias", False, False),
    ("post_norm.scale", _V + "layernorm_post.weight", False, False),
    ("post_norm.bias", _V + "layernorm_post.bias", False, False),
    ("layers.attn_norm.scale", _L + "input_layernorm.weight", True, False),
    ("layers.attn_norm.bias", _L + "input_layernorm.bias", True, False),
    ("layers.wq", _L + "self_attn.q_proj.weight", True, True),
    ("layers.bq", _L + "self_attn.q_proj.bias", True, False),
    ("layers.wk", _L + "self_attn.k_proj.weight", True, True),
    ("layers.bk", _L + "self_attn.k_proj.bias", True, False),
    ("layers.wv", _L + "self_attn.v_proj.weight", True, True),
    ("layers.bv", _L + "self_attn.v_proj.bias", True, False),
    ("layers.wo", _L + "self_attn.o_proj.weight", True, True),
    ("layers.bo", _L + "self_attn.o_proj.bias", True, False),
    ("layers.mlp_norm.scale", _L + "post_attention_layernorm.weight", True, False),
    ("layers.mlp_norm.bias", _L + "post_attention_layernorm.bias", True, False),
    ("layers.fc1", _L + "mlp.fc1.weight", True, True),
    ("layers.fc1_bias", _L + "mlp.fc1.bias", True, False),
    ("layers.fc2", _L + "mlp.fc2.weight", True, True),
    ("layers.fc2_bias", _L + "mlp.fc2.bias", True, False),
    ("adapter_fc1", _V + "vision_adapter.mlp.fc1.weight", False, True),
    ("adapter_fc2", _V + "vision_adapter.mlp.fc2.weight", False, True),
    ("projector", "multi_modal_projector.linear_1.weight", False, True),
)


def param_shapes(cfg: Llama4VisionConfig) -> dict[str, tuple[int, ...]]:
    """Each param's shape in jfire's layout (linears [in, out], layers stacked first)."""
    D, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    patch = cfg.num_channels * cfg.patch_size**2
    per_layer = {
        "attn_norm.scale": (D,), "attn_norm.bias": (D,), "mlp_norm.scale": (D,), "mlp_norm.bias": (D,),
        "wq": (D, D), "bq": (D,), "wk": (D, D), "bk": (D,), "wv": (D, D), "bv": (D,), "wo": (D, D), "bo": (D,),
        "fc1": (D, F), "fc1_bias": (F,), "fc2": (F, D), "fc2_bias": (D,),
    }  # fmt: skip
    shapes = {
        "patch_embed": (patch, D),
        "class_embedding": (D,),
        "position_embedding": (cfg.patches_per_side**2 + 1, D),
        "pre_norm.scale": (D,), "pre_norm.bias": (D,), "post_norm.scale": (D,), "post_norm.bias": (D,),
        "adapter_fc1": (F, cfg.projector_input_dim),
        "adapter_fc2": (cfg.projector_output_dim, cfg.projector_output_dim),
        "projector": (cfg.vision_output_dim, cfg.text_hidden_size),
    }  # fmt: skip
    shapes.update({f"layers.{k}": (L, *v) for k, v in per_layer.items()})
    return shapes


def hf_names(cfg: Llama4VisionConfig) -> list[str]:
    """Every tensor name the tower and projector read from a released checkpoint."""
    return [
        name.format(i=i) for _, name, per_layer, _ in PARAM_TABLE for i in (range(cfg.num_layers) if per_layer else [0])
    ]


def load_params(path, cfg: Llama4VisionConfig, dtype=jnp.float32) -> dict:
    """The tower's and projector's params from a HF safetensors directory, cast to `dtype`."""
    reader = _SafetensorsDir(Path(path))
    np_dtype = np.dtype(dtype)
    shapes = param_shapes(cfg)
    params: dict = {}
    for tree_path, hf_name, per_layer, transpose in PARAM_TABLE:
        names = [hf_name.format(i=i) for i in range(cfg.num_layers)] if per_layer else [hf_name]
        arrays = [reader.read(name) for name in names]
        arrays = [a.T if transpose else a for a in arrays]
        value = np.stack(arrays) if per_layer else arrays[0]
        if value.shape != shapes[tree_path]:
            raise JfireError(
                f"{path}: '{hf_name}' has shape {value.shape}, expected {shapes[tree_path]} (after transpose)"
            )
        _set(params, tree_path, jnp.asarray(value.astype(np_dtype)))
    return params


def _set(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


class _SafetensorsDir:
    """Tensors by name from a HF directory's model.safetensors or its sharded index, as numpy;
    each file opened once (Scout's tower is ~550 tensors over a few shards)."""

    def __init__(self, path: Path):
        self._handles: dict[Path, Any] = {}
        if (path / WEIGHT_INDEX).is_file():
            self.file_of = read_weight_map(path)
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise JfireError(f"{path} has no *.safetensors weights")
            self.file_of = {name: f for f in files for name in self._open(f).keys()}

    def _open(self, file: Path):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="numpy")
        return self._handles[file]

    def read(self, name: str) -> np.ndarray:
        file = self.file_of.get(name)
        if file is None:
            raise JfireError(f"tensor '{name}' is missing from the checkpoint")
        handle = self._open(file)
        if handle.get_slice(name).get_dtype() != "BF16":
            return handle.get_tensor(name)
        return _read_bf16(file, name)  # safetensors' numpy reader has no bfloat16


def _read_bf16(file: Path, name: str) -> np.ndarray:
    with open(file, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(header_size))[name]
        start, end = info["data_offsets"]
        f.seek(8 + header_size + start)
        raw = f.read(end - start)
    return np.frombuffer(raw, dtype=ml_dtypes.bfloat16).reshape(info["shape"])


# -- forward -------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1,))
def encode(params: dict, cfg: Llama4VisionConfig, pixel_values: jax.Array) -> jax.Array:
    """[B, 3, tile, tile] preprocessed tiles -> [B * tokens_per_tile, E] text-width
    embeddings, in the order of the prompt's `<|patch|>` tokens."""
    dtype = params["patch_embed"].dtype
    with jax.named_scope("llama4_vision_tower"):
        h = vision_tower(params, cfg, pixel_values.astype(dtype))  # [B, T, projector_output_dim]
    with jax.named_scope("llama4_projector"):
        out = jnp.einsum("btv,ve->bte", h, params["projector"])
    return out.reshape(-1, cfg.text_hidden_size)


def vision_tower(params: dict, cfg: Llama4VisionConfig, pixels: jax.Array) -> jax.Array:
    """Llama4VisionModel: [B, C, tile, tile] -> [B, T, projector_output_dim]."""
    B = pixels.shape[0]
    h = patchify(pixels, cfg.patch_size) @ params["patch_embed"]  # [B, S-1, D]
    cls = jnp.broadcast_to(params["class_embedding"], (B, 1, cfg.hidden_size))
    h = jnp.concatenate([h, cls.astype(h.dtype)], axis=1)  # [B, S, D], CLS last
    h = layer_norm(h + params["position_embedding"], params["pre_norm"])
    cos, sin = rope_tables(cfg)

    def layer(h, p):
        return encoder_layer(h, p, cfg, cos, sin), None

    h, _ = jax.lax.scan(layer, h, params["layers"])
    h = layer_norm(h, params["post_norm"])[:, :-1]  # drop CLS: [B, S-1, D]
    h = pixel_shuffle(h, cfg.pixel_shuffle_ratio)  # [B, T, F]
    h = gelu(h @ params["adapter_fc1"])
    return gelu(h @ params["adapter_fc2"])


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """[B, C, H, W] -> [B, patches (row-major), C*patch*patch], each patch's vector ordered
    channel, row, column as torch.nn.Unfold lays it out."""
    B, C, H, W = pixels.shape
    x = pixels.reshape(B, C, H // patch, patch, W // patch, patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(B, (H // patch) * (W // patch), C * patch * patch)


def encoder_layer(h, p, cfg: Llama4VisionConfig, cos, sin):
    B, S, D = h.shape
    H, K = cfg.num_heads, cfg.head_dim
    with jax.named_scope("attention"):
        x = layer_norm(h, p["attn_norm"])
        q = (x @ p["wq"] + p["bq"]).reshape(B, S, H, K)
        k = (x @ p["wk"] + p["bk"]).reshape(B, S, H, K)
        v = (x @ p["wv"] + p["bv"]).reshape(B, S, H, K)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32) * K**-0.5
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # no mask: every token sees the tile
        attn = jnp.einsum("bhqs,bshk->bqhk", probs, v).reshape(B, S, D)
        h = h + attn @ p["wo"] + p["bo"]
    with jax.named_scope("mlp"):
        x = layer_norm(h, p["mlp_norm"])
        h = h + gelu(x @ p["fc1"] + p["fc1_bias"]) @ p["fc2"] + p["fc2_bias"]
    return h


def rope_tables(cfg: Llama4VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [S, K/2] for each token's adjacent (even, odd) pairs of head dims: the
    first K/4 pairs turn with the patch's column + 1, the last K/4 with its row + 1, and the
    CLS token (last) not at all. Float32 as transformers computes them; constants under jit."""
    side = cfg.patches_per_side
    freq_dim = cfg.head_dim // 2
    steps = np.arange(0, freq_dim, 2)[: freq_dim // 2].astype(np.float32) / np.float32(freq_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(cfg.rope_theta), steps)  # [K/4]
    index = np.arange(side * side)
    cols, rows = (index % side + 1).astype(np.float32), (index // side + 1).astype(np.float32)
    angles = np.concatenate([cols[:, None] * inv_freq, rows[:, None] * inv_freq], axis=1)  # [S-1, K/2]
    angles = np.concatenate([angles, np.zeros((1, freq_dim), np.float32)])  # CLS
    return np.cos(angles), np.sin(angles)


def apply_rope(x: jax.Array, cos, sin) -> jax.Array:
    """Rotates adjacent pairs (a complex multiply per pair), in float32 as transformers does."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)  # [B, S, H, K/2, 2]
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def pixel_shuffle(h: jax.Array, ratio: float) -> jax.Array:
    """[B, N, C] on a square grid -> [B, N*ratio^2, C/ratio^2], folding neighbouring columns
    then rows into channels with the same reshapes and transposes as transformers."""
    B, N, C = h.shape
    side = int(round(N**0.5))
    x = h.reshape(B, side, int(side * ratio), int(C / ratio))
    x = x.transpose(0, 2, 1, 3)
    x = x.reshape(B, int(side * ratio), int(side * ratio), int(C / ratio**2))
    x = x.transpose(0, 2, 1, 3)
    return x.reshape(B, -1, x.shape[-1])


def layer_norm(x: jax.Array, p: dict) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    normed = (xf - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS)
    return (normed * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)  # nn.GELU(): the exact erf form
