"""Compressed jfire checkpoints: bf16 weights stored losslessly compressed, decoded on the device.

  DST/jfire.json   {"format": 2, ..., "compression": {"codec", "codec_version", "code_bits",
                    "tensors": {name: {"stored": "huffman" | "raw", "layout", "payload_words",
                                       "checksum", "bytes"}}}}
  DST/params/      orbax-checkpoint: a raw tensor is its bf16 array; a compressed one is
                   {"code_lengths", "lane_bits", "raw", "payload"} (see jfire.kernels.bf16_decode)

Loading restores the compressed arrays onto the device and decodes them there (the Pallas
kernel; interpret mode on CPU). Every tensor's checksum is recomputed from the decoded bits
and compared with the manifest, so a corrupted or truncated checkpoint is refused by name,
never loaded as wrong weights.

Layer-stacked weights are coded per layer (a unit), so `keep_compressed=True` can leave
them compressed in device memory for `jfire.kernels.layer_weights.layer_slice` to decode
inside the layer loop.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jfire.checkpoint import codec, store
from jfire.errors import JfireError
from jfire.kernels.bf16_decode import CODE_BITS, Compressed, Layout, pad_payload
from jfire.kernels.layer_weights import decode, default_decoder
from jfire.models.family import Family
from jfire.models.params import get_path, set_path
from jfire.sharding import RULES

FORMAT_VERSION = 2
CODEC = "bf16-exponent-huffman"
CODEC_VERSION = 1
# Logical axes a mesh may shard (jfire.sharding's rules) become the rows of the encode
# layout, so that every shard is a set of whole rows (docs/compression.md). The layout is
# recorded per tensor, so later rule changes do not affect existing checkpoints.
SHARDABLE_AXES = tuple(name for name, rule in RULES.items() if rule)
ARRAYS = ("code_lengths", "lane_bits", "raw", "payload")


def layout_for(spec) -> Layout:
    """A ParamSpec's layout: layers are units; sharded axes, in order, are rows; the rest columns."""
    unit = 1 if spec.per_layer else 0
    rest = range(unit, len(spec.shape))
    rows = [a for a in rest if spec.axes[a] in SHARDABLE_AXES]
    cols = [a for a in rest if spec.axes[a] not in SHARDABLE_AXES]
    return codec.make_layout(spec.shape, (0,) * unit + tuple(rows) + tuple(cols), unit, len(rows))


def compress_params(config, params: dict, progress=None) -> tuple[dict, dict]:
    """(the tree orbax saves, the manifest's "compression" section) for bf16 params."""
    tree: dict = {}
    tensors = {}
    for spec in config.param_specs():
        if spec.dtype is not None:
            # Params held in their own dtype (packed int4 words, a float32 bias) are stored as
            # they are: the bf16 codec does not apply to them.
            value = np.asarray(get_path(params, spec.name)).astype(spec.dtype)
            set_path(tree, spec.name, value)
            tensors[spec.name] = {
                "checksum": codec.checksum(_words(value)),
                "original_bytes": value.nbytes,
                "stored": "raw",
                "bytes": value.nbytes,
            }
            continue
        value = codec.as_bits(np.asarray(get_path(params, spec.name)))
        entry = {"checksum": codec.checksum(value), "original_bytes": value.nbytes}
        c = codec.maybe_encode(value, layout_for(spec))
        if c is None:
            set_path(tree, spec.name, value.view(ml_dtypes.bfloat16))
            entry.update(stored="raw", bytes=value.nbytes)
        else:
            set_path(tree, spec.name, {name: getattr(c, name) for name in ARRAYS})
            entry.update(
                stored="huffman", layout=c.layout.to_dict(), payload_words=int(c.payload.shape[0]), bytes=c.nbytes
            )
        tensors[spec.name] = entry
        if progress:
            progress(spec.name)
    section = {"codec": CODEC, "codec_version": CODEC_VERSION, "code_bits": CODE_BITS, "tensors": tensors}
    return tree, section


def is_compressed(manifest: dict) -> bool:
    return manifest.get("format") == FORMAT_VERSION


def check_section(path: Path, manifest: dict, specs) -> dict:
    """The manifest's compression section, refused unless this jfire reads it and it covers the model."""
    section = manifest.get("compression")
    if not isinstance(section, dict) or not isinstance(section.get("tensors"), dict):
        raise JfireError(
            f"{path}/jfire.json is a compressed checkpoint without its 'compression' section; convert again"
        )
    if (section.get("codec"), section.get("codec_version"), section.get("code_bits")) != (
        CODEC,
        CODEC_VERSION,
        CODE_BITS,
    ):
        raise JfireError(
            f"{path} is compressed with codec {section.get('codec')!r} version {section.get('codec_version')!r}; "
            f"this jfire reads {CODEC!r} version {CODEC_VERSION} (convert the model again)"
        )
    for spec in specs:
        entry = section["tensors"].get(spec.name)
        try:
            assert entry["stored"] in ("raw", "huffman") and isinstance(entry["checksum"], int)
            shape = Layout.from_dict(entry["layout"]).shape if entry["stored"] == "huffman" else spec.shape
            assert entry["stored"] == "raw" or isinstance(entry["payload_words"], int)
        except (AssertionError, KeyError, TypeError, ValueError):
            raise JfireError(
                f"{path}/jfire.json does not describe tensor '{spec.name}' properly; convert the model again"
            ) from None
        if shape != spec.shape:
            raise JfireError(
                f"{path}/jfire.json: tensor '{spec.name}' is stored with shape {shape} "
                f"but the config implies {spec.shape}"
            )
    return section


def abstract_tree(specs, section: dict, sharding) -> dict:
    """What orbax restores: ShapeDtypeStructs of the stored arrays, placed by `sharding`."""
    tree: dict = {}
    for spec in specs:
        entry = section["tensors"][spec.name]
        if entry["stored"] == "raw":
            set_path(tree, spec.name, jax.ShapeDtypeStruct(spec.shape, spec.dtype or jnp.bfloat16, sharding=sharding))
            continue
        lay = Layout.from_dict(entry["layout"])
        shapes = {
            "code_lengths": ((lay.units, 256), jnp.uint8),
            "lane_bits": ((lay.units, lay.rows, lay.lanes), jnp.uint16),
            "raw": ((lay.units, lay.rows, lay.cols), jnp.uint8),
            "payload": ((int(entry["payload_words"]),), jnp.uint32),
        }
        set_path(tree, spec.name, {k: jax.ShapeDtypeStruct(s, d, sharding=sharding) for k, (s, d) in shapes.items()})
    return tree


# -- decoding and checking --------------------------------------------------------------------------


@jax.jit
def device_checksum(x: jax.Array) -> jax.Array:
    """codec.checksum computed on the device from bf16 values (or, for a param held in its own
    4-byte dtype, from its 16-bit words as `_words` orders them; FP8 is exact in bf16): a u32 scalar."""
    if x.dtype.itemsize == 4:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).reshape(-1).astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16).reshape(-1).astype(jnp.uint32)
    weights = codec.mix32(jax.lax.iota(jnp.uint32, bits.shape[0])) | jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnames=("decoder",))
def _decode_encoded(c: Compressed, decoder: str) -> jax.Array:
    return decode(c, decoder)


@functools.partial(jax.jit, static_argnames=("layout",))
def _in_order_checked(values: jax.Array, layout: Layout):
    values = values.reshape(layout.enc_shape).transpose(np.argsort(layout.perm))
    return values, device_checksum(values)


def decode_checked(c: Compressed, decoder: str) -> tuple[jax.Array, jax.Array]:
    """(bf16 values, their checksum), both on the device.

    Decoded in encode layout with the payload padded to a power of two, then put back in
    order: tensors of one encode shape (w_gate, w_up and w_down, say) share one compiled
    decoder, which matters where compiling it costs more than running it (interpret mode).
    """
    flat = dataclasses.replace(c, layout=c.layout.encoded())
    flat = pad_payload(flat, 1 << (c.payload.shape[0] - 1).bit_length())
    return _in_order_checked(_decode_encoded(flat, decoder), c.layout)


def check_tables(path: Path, name: str, c: Compressed) -> None:
    """Refuses code tables that are not complete prefix codes, and lane lengths that do not
    add up to the payload: the decoders would survive such garbage, but it must not load."""
    lengths = np.asarray(c.code_lengths)
    lane_bits = np.asarray(c.lane_bits).astype(np.int64)
    words = int(((lane_bits.sum(axis=-1) + 31) // 32).sum())
    if not all(codec.kraft_complete(unit) for unit in lengths) or words + 1 != c.payload.shape[0]:
        raise JfireError(
            f"{path}: tensor '{name}' has invalid code tables or lane lengths; "
            "the checkpoint is corrupt (convert the model again)"
        )


def decode_tree(
    path: Path, specs, section: dict, stored: dict, dtype, decoder: str, keep_compressed: bool = False
) -> dict:
    """Decodes every restored tensor on its device and checks it against the manifest."""
    params: dict = {}
    checksums = {}
    for spec in specs:
        leaf = get_path(stored, spec.name)
        entry = section["tensors"][spec.name]
        if entry["stored"] == "raw":
            value, checksums[spec.name] = leaf, device_checksum(leaf)
        else:
            c = Compressed(layout=Layout.from_dict(entry["layout"]), **{k: leaf[k] for k in ARRAYS})
            check_tables(path, spec.name, c)
            value, checksums[spec.name] = decode_checked(c, decoder)
            if keep_compressed and spec.per_layer:
                value = c
        set_path(stored, spec.name, None)  # freed as decoded: device memory stays near the decoded size
        own = spec.dtype or dtype
        set_path(params, spec.name, value if isinstance(value, Compressed) else value.astype(own))
    for name, checksum in jax.device_get(checksums).items():
        want = section["tensors"][name]["checksum"]
        if int(checksum) != want:
            raise JfireError(
                f"{path}: tensor '{name}' fails its checksum (stored {want:#010x}, decoded "
                f"{int(checksum):#010x}); the checkpoint is corrupt (convert the model again)"
            )
    return params


# -- keeping layers compressed ------------------------------------------------------------------------


def _words(value: np.ndarray) -> np.ndarray:
    """The 16-bit words `device_checksum` sums for a param held in its own dtype: a 4-byte
    array's in memory order (as the device's bitcast splits them); FP8 codes as the bf16 values
    they equal exactly."""
    if value.dtype.itemsize == 1:
        return codec.as_bits(np.ascontiguousarray(value))
    return np.ascontiguousarray(value).view(np.uint16)


def compressed_bytes(params: dict) -> int:
    """Device bytes held by a params tree, counting compressed leaves at their stored size."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Compressed))
    return sum(leaf.nbytes if isinstance(leaf, Compressed) else leaf.size * leaf.dtype.itemsize for leaf in leaves)


def ratio(section: dict) -> float:
    tensors = section["tensors"].values()
    return sum(t["bytes"] for t in tensors) / max(1, sum(t["original_bytes"] for t in tensors))


# -- saving and restoring -----------------------------------------------------------------------------


def save(dst: Path, config, params: dict, progress=None) -> dict:
    """Writes a compressed checkpoint of bf16 `params` (host or device arrays) into dst;
    returns the compression section written to the manifest."""
    tree, section = compress_params(config, params, progress)
    store.save(dst, config, tree, "bfloat16", compression=section)
    return section


def restore(
    path: Path, manifest: dict, dtype, *, decoder: str | None = None, keep_compressed: bool = False, shardings=None
) -> tuple[Family, dict]:
    """Config and params of a compressed checkpoint, decoded on the device and checked.

    With `shardings` the decoded params are then placed by them; each device decoding only
    its own rows is the layout's design (docs/compression.md) but not done here yet.
    """
    if keep_compressed and shardings is not None:
        raise JfireError("keeping layers compressed is not supported on a mesh yet")
    path = Path(path).absolute()
    config = store.config_of(manifest)
    specs = config.param_specs()
    section = check_section(path, manifest, specs)
    target = abstract_tree(specs, section, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    stored = _read_stored(path, specs, target)
    params = decode_tree(path, specs, section, stored, dtype, decoder or default_decoder(), keep_compressed)
    if shardings is not None:
        params = jax.device_put(params, shardings)
    return config, params


def _read_stored(path: Path, specs, target: dict) -> dict:
    """The stored arrays, on the device. When orbax fails (a truncated or damaged file), each
    tensor is read on its own to name the one that cannot be read."""
    import orbax.checkpoint as ocp

    store._quiet_orbax()
    try:
        with ocp.StandardCheckpointer(**store.process_local()) as ckptr:
            return ckptr.restore(path / "params", target)
    except Exception as e:
        error = _reason(e)
    for spec in specs:
        item: dict = {}
        set_path(item, spec.name, get_path(target, spec.name))
        try:
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(), **store.process_local()) as ckptr:
                ckptr.restore(
                    path / "params",
                    args=ocp.args.PyTreeRestore(
                        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
                    ),
                )
        except Exception as e:
            raise JfireError(
                f"{path}: tensor '{spec.name}' cannot be read ({_reason(e)}); the checkpoint "
                "is truncated or corrupt (convert the model again)"
            ) from None
    raise JfireError(f"cannot restore the weights in {path}/params: {error}")


def _reason(e: Exception) -> str:
    # TensorStore appends a page of its own spec to the one line that matters.
    return store._first_line(e).split(" See full TensorStore details")[0].rstrip(".")
