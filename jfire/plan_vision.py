"""`jfire plan`'s vision tower: what a multimodal model's image encoder costs the device that
holds it, from the config alone (jfire/plan.py adds it to that device's row).

  parameters  the tower's and projector's params, counted from the family's own declaration
              (`llama4.param_shapes`, `kimi_k25.param_shapes`: the shapes their loaders check
              every released tensor against), each in the serving dtype (the loaders cast every
              tensor to it)
  placement   as the engine places them (jfire.runner.load_vision -> jfire.vision.model): whole,
              on the process's default device (its first local device), in every process of
              an engine that prefills; not sharded or replicated over the mesh. A group spanning
              processes holds one copy per process; only its leader (the first device) encodes.
              An engine that only decodes (a disaggregated decode group) holds none.
  workspace   the temporaries, outputs and pixel inputs of the largest encoder call the engine
              can make for one image (`largest_call`): XLA's memory_analysis() of the family's
              own jitted encode lowered from ShapeDtypeStructs on a CPU device (nothing is
              allocated), in float32 (the text programs' WORKSPACE_DTYPE: an upper bound for a
              GPU's bf16), or with `compile=False` `estimate_encoder_workspace`'s formula.

The encoder runs on the host's request, between the engine's programs and on the same device,
never beside one: the device needs the larger of the programs' and the encoder's workspace,
not their sum (jfire/plan.py). The engine encodes all of a step's new images in one call
(jfire.vision.encoder); the plan counts one image of the largest size per call.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jfire.errors import JfireError
from jfire.plan_workspace import WORKSPACE_DTYPE


@dataclasses.dataclass(frozen=True)
class VisionTower:
    """A model's image encoder as the plan sees it: its config and the largest call."""

    family: str  # "llama4" or "kimi_k25", as jfire.vision.model names them
    config: Any  # llama4.Llama4VisionConfig or kimi_k25.KimiK25VisionConfig
    size: int  # the largest call: Llama 4 tiles, Kimi K2.5 patches padded to the bucket
    call: str  # the largest call in words

    def declaration(self) -> dict:
        """The params' shapes as the family declares them (`param_shapes`), nested as its encode
        takes them; the encoder layers stacked under "layers"."""
        from jfire.vision import kimi_k25, llama4

        module = llama4 if self.family == "llama4" else kimi_k25
        return _nested(module.param_shapes(self.config))

    def param_shapes(self) -> list[tuple[int, ...]]:
        """Every param's shape (layers stacked)."""
        return _shapes(self.declaration())

    def parameters(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes())

    def param_bytes(self, dtype) -> int:
        return self.parameters() * np.dtype(dtype).itemsize

    def abstract_call(self, dtype=WORKSPACE_DTYPE):
        """(the family's jitted encode, its arguments as ShapeDtypeStructs, the bytes of those
        that are not params): the largest call, exactly as jfire.vision.model makes it."""
        from jfire.vision import kimi_k25, llama4

        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), self.declaration(), is_leaf=_is_shape)
        if self.family == "llama4":
            c = self.config
            pixels = jax.ShapeDtypeStruct((self.size, c.num_channels, c.image_size, c.image_size), np.float32)
            return llama4.encode, (params, c, pixels), _nbytes(pixels)
        # Kimi K2.5: `encode` packs the images on the host and pads them to the bucket; the packed
        # arrays' shapes depend on the bucket alone (a 2x2-patch image packed into it has them).
        p = self.config.patch_size
        packed = kimi_k25.pack(np.zeros((4, 3, p, p), np.float32), np.asarray([[1, 2, 2]]), self.config, self.size)
        inputs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in packed[:-1]]
        return kimi_k25.encode_padded, (params, self.config, *inputs), sum(_nbytes(a) for a in inputs)


def _nested(shapes: dict) -> dict:
    """Llama 4 declares its params by dotted path; the encode takes them nested."""
    out: dict = {}
    for name, shape in shapes.items():
        if isinstance(shape, dict):
            out[name] = _nested(shape)
            continue
        *parents, leaf = name.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = shape
    return out


def _is_shape(x) -> bool:
    return isinstance(x, tuple)


def _shapes(tree: dict) -> list[tuple[int, ...]]:
    return jax.tree.leaves(tree, is_leaf=_is_shape)


def _nbytes(s) -> int:
    return math.prod(s.shape) * np.dtype(s.dtype).itemsize


def read_vision_tower(model: str | Path) -> VisionTower | None:
    """The image encoder the engine loads for `model` (jfire.vision.model.load_vision_model's
    choice: a HF directory whose config.json is Llama 4 with a vision_config, or Kimi K2.5;
    None for anything else: a text-only model, a jfire checkpoint, a .gguf), with the largest
    call its image processor (preprocessor_config.json, else the released defaults) allows."""
    from jfire.vision import kimi_k25, kimi_k25_preprocess, llama4, llama4_preprocess
    from jfire.vision.model import llama4_processing, read_json, vision_family

    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    config_file = path / "config.json"
    hf = read_json(config_file)
    family = vision_family(hf)
    try:
        if family == "llama4":
            cfg = llama4.Llama4VisionConfig.from_hf(hf["vision_config"], int(hf["text_config"]["hidden_size"]))
            processing = llama4_processing(path, cfg)
            tile = processing.tile_size
            most = max(
                (h // tile) * (w // tile) for h, w in llama4_preprocess.supported_canvases(processing.max_tiles, tile)
            )
            tiles = most + (most > 1)  # the global tile, with more than one
            positions = cfg.patches_per_side**2 + 1
            return VisionTower(
                "llama4",
                cfg,
                tiles,
                f"{tiles} tiles ({most} + the global one) of {positions} positions, attention per tile",
            )
        if family == "kimi_k25":
            kimi = kimi_k25.KimiK25VisionConfig.from_hf(hf)
            limits = kimi_k25_preprocess.PreprocessConfig.from_hf(read_json(path / "preprocessor_config.json"))
            # Padding each side to whole 2x2 groups can take an image past max_patches (1800 x 1800
            # pixels: 128 x 128 patches, padded to 130 x 130), never past twice it (tests/test_plan.py
            # sweeps image sizes): the largest bucket an image is padded to is that of 2 x max_patches.
            bucket = kimi_k25.patch_bucket(2 * limits.max_patches)
            return VisionTower(
                "kimi_k25",
                kimi,
                bucket,
                f"one image of up to {limits.max_patches:,} patches (more once padded to whole 2x2 groups), "
                f"padded to the {bucket:,}-patch bucket, attention over all of it in blocks of {kimi_k25.BLOCK} queries",
            )
    except KeyError as e:
        raise JfireError(f"{config_file}: the vision config lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise JfireError(f"{config_file}: the vision config is not one jfire builds ({e})") from None
    return None


def measure_encoder_workspace(tower: VisionTower) -> dict:
    """XLA's memory analysis of the largest encoder call, compiled for one CPU device from
    abstract params in WORKSPACE_DTYPE: temporaries + outputs + the pixel inputs (the params
    are counted as weights)."""
    fn, args, inputs = tower.abstract_call(WORKSPACE_DTYPE)
    stats = fn.lower(*args).compile().memory_analysis()
    temp, outputs = int(stats.temp_size_in_bytes), int(stats.output_size_in_bytes)
    return {
        "temp_bytes": temp,
        "output_bytes": outputs,
        "input_bytes": inputs,
        "workspace_bytes": temp + outputs + inputs,
    }


def estimate_encoder_workspace(tower: VisionTower) -> int:
    """The stated stand-in for `measure_encoder_workspace`, in WORKSPACE_DTYPE (4-byte) values:
      one layer's weights (a scanned layer's slices are materialised)
    + the attention logits held at once (Llama 4: every tile's [heads, positions, positions];
      Kimi K2.5: one block of queries against every key, [heads, BLOCK, patches])
    + 3 x width + MLP width for every position (the residual, the normed input, the attention
      output; the MLP's intermediate)
    + the call's outputs (its rows at the text width) and its pixel inputs."""
    from jfire.vision import kimi_k25

    c = tower.config
    w = np.dtype(WORKSPACE_DTYPE).itemsize
    layer = sum(math.prod(s[1:]) for s in _shapes(tower.declaration()["layers"]))
    _, _, inputs = tower.abstract_call(WORKSPACE_DTYPE)
    if tower.family == "llama4":
        per_tile = c.patches_per_side**2 + 1
        positions = tower.size * per_tile
        logits = tower.size * c.num_heads * per_tile * per_tile
        outputs = tower.size * c.tokens_per_tile * c.text_hidden_size
        width, mlp = c.hidden_size, c.intermediate_size
    else:
        positions = tower.size
        logits = c.num_heads * min(kimi_k25.BLOCK, positions) * positions
        outputs = positions // c.merge_size**2 * c.text_hidden_size
        width, mlp = c.hidden_size, c.intermediate_size
    return (layer + logits + positions * (3 * width + mlp) + outputs) * w + inputs


def holders(spec, devices: list) -> list:
    """The devices holding the tower: each process's first device (its default device; the
    mesh's devices are laid out host by host), the first of them also running the encoder."""
    size = max(1, spec.size)
    per_host = size // max(1, spec.hosts)
    return [devices[k * per_host] for k in range(max(1, spec.hosts))]
