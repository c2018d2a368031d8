"""Reading a Hugging Face directory or a GGUF file into host arrays: the weight sources, the
dtypes, every declared parameter checked and cast. Below both loading (jfire.checkpoint.load)
and conversion (jfire.checkpoint.convert), which place or store what this reads."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jfire.checkpoint.sources import GGUFSource, HFDirSource
from jfire.errors import JfireError
from jfire.models.family import Family
from jfire.models.params import set_path, spec_dtype
from jfire.tokenizer import Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_dtype(name: str):
    if name not in DTYPES:
        raise JfireError(f"unknown dtype {name!r}; use one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def open_source(path: Path):
    """The weight source for a HF directory or a GGUF file, with a clear error otherwise."""
    if not path.exists():
        raise JfireError(
            f"model path {str(path)!r} does not exist (give a HF directory, a .gguf file, a jfire checkpoint or 'default')"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise JfireError(f"{path} is a file but not a .gguf; give a .gguf file or a model directory")
        return GGUFSource(path)
    return HFDirSource(path)


def read_params(source, config: Family, dtype, progress: Callable | None = None) -> dict:
    """Reads every declared parameter from `source` (HF names and layout), checked and cast,
    as host (numpy) arrays: placing them is the caller's choice (one device, or a mesh where
    each device receives only its shard)."""
    np_dtype = np.dtype(dtype)
    note_skipped(source, config)
    params: dict = {}
    for spec in config.param_specs():
        layers = spec.layers if spec.per_layer else [None]
        slices = []
        for i in layers:
            name = spec.hf.format(i=i, e="{e}") if i is not None else spec.hf
            if spec.per_expert:
                experts = [
                    _read_one(source, spec, name.format(e=e), np_dtype, progress)
                    for e in range(spec.shape[1 if spec.per_layer else 0])
                ]
                slices.append(np.stack(experts))
            else:
                slices.append(_read_one(source, spec, name, np_dtype, progress))
        set_path(params, spec.name, np.stack(slices) if spec.per_layer else slices[0])
    return params


def note_skipped(source, config: Family) -> str | None:
    """One line naming the source tensors the family deliberately leaves unread (a vision
    tower beside the text model), printed to stderr; None when there are none."""
    prefixes = config.skipped_source_prefixes()
    skipped = [n for n in source.names() if n.startswith(prefixes)] if prefixes else []
    if not skipped:
        return None
    line = (
        f"jfire: {source.path.name}: skipping {len(skipped)} tensors under "
        f"{', '.join(p.rstrip('.') for p in prefixes)} (not part of the text model jfire serves)"
    )
    print(line, file=sys.stderr, flush=True)
    return line


def _read_one(source, spec, name: str, np_dtype, progress) -> np.ndarray:
    tensor = source.get(name, spec)
    if tuple(tensor.shape) != spec.source_shape:
        raise JfireError(f"tensor '{name}' has shape {tuple(tensor.shape)} but the config implies {spec.source_shape}")
    if spec.dtype == "float8_e4m3fn" and tensor.dtype != spec_dtype(spec, None):
        # Casting other values to FP8 would round them: the config promised FP8 tensors.
        raise JfireError(
            f"tensor '{name}' is {tensor.dtype}, but the config's quantization_config says the routed "
            "experts are stored float8_e4m3fn; fix the config or the checkpoint"
        )
    if progress:
        progress(name)
    return spec.from_source(np.asarray(tensor)).astype(spec_dtype(spec, np_dtype))


def count_source_tensors(config: Family) -> int:
    return sum(
        (s.shape[0] if s.per_layer else 1) * (s.shape[1 if s.per_layer else 0] if s.per_expert else 1)
        for s in config.param_specs()
    )


def tokenizer_of(model: str | Path | GGUFSource | HFDirSource) -> Tokenizer | None:
    """The tokenizer of any checkpoint jfire reads; the one place that decides it. A GGUF file's
    is built from its vocabulary and merges; a directory's, a HF source or a jfire checkpoint
    (conversion saves the source's tokenizer beside the weights), is read from its tokenizer
    files, None when it has none. `model` is the checkpoint's path, or the source that
    `open_source` already opened for it."""
    if isinstance(model, str | Path):
        path = Path(model)
        return Tokenizer.from_dir(path) if path.is_dir() else tokenizer_of(open_source(path))
    if isinstance(model, GGUFSource):
        return Tokenizer.from_gguf(model.reader)
    return Tokenizer.from_dir(model.path)
