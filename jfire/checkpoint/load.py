"""Turning `--model` into a config, weights on the device, and a tokenizer.

`--model` is a HF directory, a .gguf file, a jfire checkpoint directory, a Hugging Face id
(`org/name`, found in the local Hugging Face cache: `jfire.checkpoint.hub`), or `default` (the
embedded SmolLM2-135M-Instruct, converted once into checkpoints/ on first use).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from jfire import sharding
from jfire.checkpoint import compressed, hub, store
from jfire.checkpoint.read import DTYPES, open_source, parse_dtype, read_params, tokenizer_of
from jfire.errors import JfireError
from jfire.models import cpu_coded
from jfire.models.family import Family, Parallel
from jfire.tokenizer import Tokenizer


def kv_dtype_of(dtype: str, *, mesh_size: int, platform: str) -> str:
    """The dtype of the activations and KV cache for weights of `dtype` on `mesh_size` devices
    of `platform` (`LoadedModel.kv_dtype`; the plan asks it before a model is loaded)."""
    return "float32" if dtype == "bfloat16" and mesh_size == 1 and platform == "cpu" else dtype


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
    def kv_dtype(self):
        """The dtype of the activations and the KV cache: the weights', except bfloat16 weights
        on one CPU device, which compute in float32. A CPU has no fast bfloat16 arithmetic, and
        decode there is bound by the bytes of weight it reads: the matmul kernels widen bfloat16
        weights in registers (jfire.kernels.cpu_matmul), so half the bytes are read and nothing
        is rounded to bfloat16 but the weights themselves (llama.cpp runs BF16 weights the same
        way). The embedding's rows are widened as they are looked up (the models' `decoder`)."""
        mesh_size = 1 if self.mesh is None else self.mesh.size
        return DTYPES[kv_dtype_of(self.dtype, mesh_size=mesh_size, platform=self.platform)]

    @property
    def platform(self) -> str:
        """Where the params live: "cpu", "gpu", "tpu"."""
        return next(iter(jax.tree.leaves(self.params)[0].devices())).platform

    @property
    def parallel(self) -> Parallel | None:
        """The mesh for blocks that place their own collectives (expert dispatch)."""
        if self.mesh is None or (self.mesh.shape["ep"] == 1 and self.mesh.shape["tp"] == 1):
            return None
        return Parallel(self.mesh)


def resolve_model_path(model: str | None, checkpoints_dir: Path | None = None) -> tuple[Path, str]:
    """(path, name) for `--model`, the one place every command resolves it: `default` is
    converted into checkpoints/ on first use; a path that exists is itself; an `org/name`
    that is not a path is the snapshot directory of that Hugging Face id in the local cache."""
    if model is None or model == "default":
        from jfire.checkpoint.default_model import ensure_default_checkpoint

        return ensure_default_checkpoint(checkpoints_dir), "default"
    return hub.resolve_source(model), model


def load_config_and_tokenizer(
    model: str | None, checkpoints_dir: Path | None = None
) -> tuple[Family, Tokenizer | None, str]:
    """What a frontend needs without the weights: (config, tokenizer, name)."""
    path, name = resolve_model_path(model, checkpoints_dir)
    if store.is_checkpoint(path):
        return store.read_config(path), tokenizer_of(path), name
    source = open_source(path)
    return source.config, tokenizer_of(source), name


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
    decoded layer by layer as the model runs. In bfloat16 on one CPU device it keeps any
    source's layer weights palette-coded in memory instead, multiplied coded
    (jfire.kernels.cpu_palette)."""
    target = parse_dtype(dtype)
    path, name = resolve_model_path(model, checkpoints_dir)
    mesh, replication = None, 1
    coded_on_cpu = keep_compressed and dtype == "bfloat16" and mesh_spec is None and jax.default_backend() == "cpu"
    if coded_on_cpu:
        keep_compressed = False  # the weights load decoded, then take the CPU's coded form
    if store.is_checkpoint(path):
        config = store.read_config(path)
        mesh = _mesh_for(mesh_spec, config, devices)
        shardings = sharding.param_shardings(config, mesh) if mesh else None
        manifest = store.read_manifest(path)
        if manifest["format"] == store.COMPRESSED_FORMAT:
            config, params = compressed.restore(
                path.absolute(), manifest, target, shardings=shardings, keep_compressed=keep_compressed
            )
        elif keep_compressed:
            raise JfireError(
                f"{path} is not compressed; --keep-compressed needs a checkpoint converted with --compress"
            )
        else:
            config, params = store.restore(path, target, shardings=shardings)
        tokenizer = tokenizer_of(path)
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
        tokenizer = tokenizer_of(source)
    if mesh is not None:
        config, params, replication = sharding.adapt_to_mesh(config, params, mesh)
    elif keep_compressed and jax.default_backend() == "gpu":
        # Palette-coded linear layers multiplied coded where the device measures it faster.
        params = compressed.fuse_layers(params, config, target)
    if coded_on_cpu:
        params = cpu_coded.code_params(params, config)
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
