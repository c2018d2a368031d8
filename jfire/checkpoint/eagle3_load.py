"""Loading an EAGLE-3 draft head (jfire.models.eagle3) from a local Hugging Face directory:
`config.json` plus `model.safetensors` (or a sharded index, or any `*.safetensors`), else
`pytorch_model.bin` (read with torch, which only the .bin path needs).

Why not jfire.checkpoint.sources.HFDirSource: it builds a target model's config from the
registry, and a draft head is not a servable model. The tensors are read here by name, from
the safetensors header and the file's bytes (bf16, int64 and bool included).

The published layouts differ only in where the one decoder layer lives (`midlayer.`,
`layers.0.` or `model.layers.0.`), whether `fc` / `norm` / `embed_tokens` carry a `model.`
prefix, and which optional tensors they ship (`embed_tokens`, `d2t`, `t2d`): the loader finds
each from the names present. tests/data/eagle3/*.json record the layouts of the published heads.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jfire.checkpoint.paths import WEIGHT_INDEX, read_weight_map
from jfire.errors import JfireError
from jfire.models.eagle3 import LAYER_PREFIXES, Eagle3Config
from jfire.models.params import ParamSpec, set_path, spec_dtype

# safetensors dtype names -> numpy dtypes (bf16 and fp8 through ml_dtypes).
_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def load_eagle3(path: str | Path, dtype=jnp.float32, *, target_embed=None) -> tuple[Eagle3Config, dict]:
    """(config, params) of the EAGLE-3 head in directory `path`, its weights cast to `dtype`
    (float32 or bfloat16; `d2t` stays int32). Without an `embed_tokens` of its own the head
    drafts with the target's: pass it as `target_embed` [vocab, hidden] to keep it in
    params["embed"] (else give it to `draft_forward` yourself, see `draft_embedding`)."""
    dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if np.dtype(dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise JfireError(f"EAGLE-3 heads load as float32 or bfloat16, not {np.dtype(dtype)}")
    path = Path(path)
    cfg = _config(path)
    weights = _open_weights(path)
    cfg = _locate(cfg, weights.names, path)
    params: dict = {}
    for spec in cfg.param_specs():
        set_path(params, spec.name, _read(weights, spec, dtype, path))
    embed_spec, d2t_spec = cfg.optional_specs()
    if embed_spec.hf in weights.names:
        params["embed"] = _read(weights, embed_spec, dtype, path)
    elif target_embed is not None:
        if tuple(target_embed.shape) != embed_spec.shape:
            raise JfireError(
                f"the target embedding is {tuple(target_embed.shape)}, but the EAGLE-3 head in {path} "
                f"needs {embed_spec.shape} (vocab_size, hidden_size)"
            )
        params["embed"] = np.asarray(target_embed).astype(dtype)
    params["d2t"] = _d2t(cfg, weights, d2t_spec, path)
    _check_t2d(cfg, weights, path)
    return cfg, _to_device(params)


def _config(path: Path) -> Eagle3Config:
    file = path / "config.json"
    if not path.is_dir():
        raise JfireError(f"EAGLE-3 head path {str(path)!r} is not a directory (give a HF directory)")
    if not file.is_file():
        raise JfireError(f"{path} has no config.json; an EAGLE-3 head directory needs one")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise JfireError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise JfireError(f"{file} must hold a JSON object, not a {type(hf).__name__}")
    try:
        return Eagle3Config.from_hf(hf)
    except JfireError:
        raise
    except KeyError as e:
        raise JfireError(f"{file} lacks the required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise JfireError(f"{file} has a value of the wrong type ({e})") from None


def _locate(cfg: Eagle3Config, names: set[str], path: Path) -> Eagle3Config:
    """The config with `layer_prefix` and `prefix` set to where this checkpoint keeps them."""
    layer = next((p for p in LAYER_PREFIXES if p + "hidden_norm.weight" in names), None)
    if layer is None:
        raise JfireError(
            f"{path}: no EAGLE-3 decoder layer found (looked for "
            + ", ".join(repr(p + "hidden_norm.weight") for p in LAYER_PREFIXES)
            + ")"
        )
    top = "model." if "fc.weight" not in names and "model.fc.weight" in names else ""
    return dataclasses.replace(cfg, layer_prefix=layer, prefix=top)


def _read(weights: _Weights, spec: ParamSpec, dtype, path: Path) -> np.ndarray:
    assert spec.hf is not None
    if spec.hf not in weights.names:
        raise JfireError(f"{path}: tensor '{spec.hf}' is missing (expected shape {spec.source_shape})")
    tensor = weights.get(spec.hf)
    if tuple(tensor.shape) != spec.source_shape:
        raise JfireError(
            f"{path}: tensor '{spec.hf}' has shape {tuple(tensor.shape)} but config.json implies "
            f"{spec.source_shape} ({_config_note(spec)}); the config and the weights disagree"
        )
    return spec.from_source(np.asarray(tensor).astype(np.float32)).astype(spec_dtype(spec, dtype))


def _config_note(spec: ParamSpec) -> str:
    if spec.name == "fc":
        return "[hidden_size, number of aux layers x target_hidden_size]"
    if spec.name == "lm_head":
        return "[draft_vocab_size, hidden_size]"
    return "from hidden_size, the head counts and widths"


def _d2t(cfg: Eagle3Config, weights: _Weights, spec: ParamSpec, path: Path) -> np.ndarray:
    """Draft-to-target id offsets: read where shipped (a head over a reduced vocabulary must
    ship them), zeros otherwise; every target id checked to lie in the target vocabulary."""
    if spec.hf not in weights.names:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise JfireError(
                f"{path}: draft_vocab_size ({cfg.draft_vocab_size}) is smaller than vocab_size "
                f"({cfg.vocab_size}) but the checkpoint has no 'd2t' to map draft ids to target ids"
            )
        return np.zeros(spec.shape, np.int32)
    d2t = np.asarray(weights.get("d2t"))
    if d2t.shape != spec.shape:
        raise JfireError(f"{path}: tensor 'd2t' has shape {d2t.shape} but draft_vocab_size implies {spec.shape}")
    targets = np.arange(cfg.draft_vocab_size) + d2t
    if targets.min() < 0 or targets.max() >= cfg.vocab_size:
        raise JfireError(f"{path}: 'd2t' maps draft ids outside the target vocabulary of {cfg.vocab_size}")
    return d2t.astype(np.int32)


def _check_t2d(cfg: Eagle3Config, weights: _Weights, path: Path) -> None:
    """`t2d` (which target ids the draft vocabulary holds) is not needed to draft, but a wrong
    length says the checkpoint was made for another target vocabulary."""
    if "t2d" in weights.names and tuple(weights.get("t2d").shape) != (cfg.vocab_size,):
        raise JfireError(
            f"{path}: tensor 't2d' has shape {tuple(weights.get('t2d').shape)} but vocab_size implies ({cfg.vocab_size},)"
        )


def _to_device(tree):
    if isinstance(tree, dict):
        return {k: _to_device(v) for k, v in tree.items()}
    return jnp.asarray(tree)


# -- the weight files ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Weights:
    """Tensor names, and a reader of one tensor by name."""

    names: set[str]
    get: Callable[[str], np.ndarray]


def _open_weights(path: Path) -> _Weights:
    """The directory's safetensors (preferred), else its pytorch_model.bin."""
    if (path / WEIGHT_INDEX).is_file():
        files = read_weight_map(path)
    else:
        single = path / "model.safetensors"
        candidates = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
        files = {name: f for f in candidates for name in _header(f)[0]}
    if files:
        return _Weights(set(files), lambda name: _safetensors_tensor(files[name], name))
    for bin_name in ("pytorch_model.bin", "model.bin"):
        if (path / bin_name).is_file():
            return _torch_weights(path / bin_name)
    raise JfireError(f"{path} has no model.safetensors (nor pytorch_model.bin): no EAGLE-3 weights to read")


def _header(file: Path) -> tuple[dict, int]:
    """The safetensors header of `file` (names -> dtype, shape, offsets) and where data starts."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise JfireError(f"{file} is not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + size


def _safetensors_tensor(file: Path, name: str) -> np.ndarray:
    header, start = _header(file)
    info = header[name]
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise JfireError(f"{file.name}: tensor '{name}' has dtype {info['dtype']}, which jfire does not read")
    begin, end = info["data_offsets"]
    if start + end > file.stat().st_size:
        raise JfireError(f"{file.name}: tensor '{name}' runs past the end of the file; it may be truncated")
    raw = np.memmap(file, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
    return raw.view(dtype).reshape(info["shape"])


def _torch_weights(file: Path) -> _Weights:
    try:
        import torch
    except ImportError:
        raise JfireError(
            f"{file} is a pytorch .bin; reading it needs torch (pip install torch), or convert it to safetensors"
        ) from None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise JfireError(f"{file} is not a readable pytorch checkpoint ({e})") from None

    def get(name: str) -> np.ndarray:
        t = state[name]
        return t.float().numpy() if t.is_floating_point() else t.numpy()

    return _Weights(set(state), get)
