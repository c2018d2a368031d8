"""Turning `--model` into a config, weights on the device, and a tokenizer.

`--model` is a HF directory, a .gguf file, a jfire checkpoint directory, or `default`
(the embedded SmolLM2-135M-Instruct, converted once into checkpoints/ on first use).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jfire import sharding
from jfire.checkpoint import store
from jfire.checkpoint.sources import GGUFSource, HFDirSource
from jfire.errors import JfireError
from jfire.models.family import Family, Parallel
from jfire.models.params import set_path, spec_dtype
from jfire.tokenizer import Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedModel:
    config: Family
    params: dict
    tokenizer: Tokenizer | None
    name: str  # what the user asked for, for messages and /v1/models
    dtype: str
    mesh: jax.sharding.Mesh | None = None  # where the params live; None = the default device
    mesh_spec: object = None  # the jfire.mesh.MeshSpec the mesh was built from
    kv_replication: int = 1  # each of the checkpoint's KV heads appears this many times in `config`

    @property
    def dtype_of_params(self):
        return DTYPES[self.dtype]

    @property
    def parallel(self) -> Parallel | None:
        """The mesh for blocks that place their own collectives (expert dispatch)."""
        if self.mesh is None or (self.mesh.shape["ep"] == 1 and self.mesh.shape["tp"] == 1):
            return None
        return Parallel(self.mesh)


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


def resolve_model_path(model: str | None, checkpoints_dir: Path | None = None) -> tuple[Path, str]:
    """(path, name) for `--model`; `default` is converted into checkpoints/ on first use."""
    if model in (None, "default"):
        from jfire.checkpoint.default_model import ensure_default_checkpoint

        return ensure_default_checkpoint(checkpoints_dir), "default"
    return Path(model).expanduser(), model


def load_config_and_tokenizer(
    model: str | None, checkpoints_dir: Path | None = None
) -> tuple[Family, Tokenizer | None, str]:
    """What a frontend needs without the weights: (config, tokenizer, name)."""
    path, name = resolve_model_path(model, checkpoints_dir)
    if store.is_checkpoint(path):
        return store.read_config(path), Tokenizer.from_dir(path), name
    source = open_source(path)
    tokenizer = Tokenizer.from_gguf(source.reader) if isinstance(source, GGUFSource) else Tokenizer.from_dir(path)
    return source.config, tokenizer, name


def load_model(
    model: str | None,
    dtype: str = "float32",
    *,
    checkpoints_dir: Path | None = None,
    mesh_spec=None,
    keep_compressed: bool = False,
    devices=None,
) -> LoadedModel:
    """Loads `model` with its weights placed on the device, or on a mesh built from
    `mesh_spec` (a jfire.mesh.MeshSpec): there each device receives only its own shards.
    `keep_compressed` leaves a compressed checkpoint's layer weights compressed on the device,
    decoded layer by layer as the model runs."""
    target = parse_dtype(dtype)
    path, name = resolve_model_path(model, checkpoints_dir)
    mesh, replication = None, 1
    if store.is_checkpoint(path):
        config = store.read_config(path)
        mesh = _mesh_for(mesh_spec, config, devices)
        config, params = store.restore(
            path,
            target,
            shardings=sharding.param_shardings(config, mesh) if mesh else None,
            keep_compressed=keep_compressed,
        )
        tokenizer = Tokenizer.from_dir(path)
    else:
        if keep_compressed:
            raise JfireError(
                f"{path} is not a compressed jfire checkpoint; --keep-compressed needs one "
                "(jfire convert SRC DST --compress)"
            )
        source = open_source(path)
        config = source.config
        mesh = _mesh_for(mesh_spec, config, devices)
        host = read_params(source, config, target)
        params = sharding.place(host, config, mesh) if mesh else jax.device_put(host)
        tokenizer = Tokenizer.from_gguf(source.reader) if isinstance(source, GGUFSource) else Tokenizer.from_dir(path)
    if mesh is not None:
        config, params, replication = sharding.adapt_to_mesh(config, params, mesh)
    return LoadedModel(
        config=config,
        params=params,
        tokenizer=tokenizer,
        name=name,
        dtype=dtype,
        mesh=mesh,
        mesh_spec=mesh_spec if mesh is not None else None,
        kv_replication=replication,
    )


def _mesh_for(mesh_spec, config: Family, devices=None):
    """The jax Mesh for a MeshSpec over `devices` (default: all), after checking it fits them
    and this model."""
    if mesh_spec is None or mesh_spec.size == 1:
        return None
    from jfire import mesh as meshes

    if devices is None and jax.process_count() > 1 and mesh_spec.size != jax.device_count():
        # A group spanning processes: every process must hold devices of the mesh.
        n, local = jax.process_count(), jax.local_device_count()
        raise JfireError(
            f"mesh {mesh_spec.name!r} has {mesh_spec.size} devices but the group's {n} processes hold "
            f"{jax.device_count()} ({local} each); a group's mesh spans every device of every process: "
            f"give each process {mesh_spec.size / n:g} devices, or use a mesh of {jax.device_count()}"
        )
    devices = list(devices if devices is not None else jax.devices())
    meshes.check_fits(mesh_spec, config, len(devices))
    return meshes.build(mesh_spec, devices)
