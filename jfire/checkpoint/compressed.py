"""Compressed jfire checkpoints: bf16 weights stored losslessly compressed, decoded on the device.

  DST/jfire.json   {"format": 2, ..., "compression": {"codec", "codec_version", "code_bits",
                    ["palette_version",] "tensors": {name: {"stored": "huffman" | "palette" | "raw",
                    "layout", "payload_words" | "exceptions", "checksum", "bytes"}}}}
  DST/params/      orbax-checkpoint: a raw tensor is its bf16 array; a Huffman-coded one is
                   {"code_lengths", "lane_bits", "raw", "payload"} (see jfire.kernels.bf16_decode),
                   a palette-coded one {"codes", "raw", "palette", "exc_start", "exc_pos",
                   "exc_exp"} (see jfire.kernels.palette_matmul)

Two codecs: Huffman (the smallest, decoded whole) and palette (fixed-rate codes any tile of
which decodes on its own, so a matmul can read them). A checkpoint with Huffman tensors only
is written exactly as before palettes existed ("bf16-exponent-huffman" version 1); one with
palette tensors is "bf16-exponent" version 2, which older readers refuse by its version.

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

from jfire.checkpoint import codec, coded_shards, store
from jfire.errors import JfireError
from jfire.kernels.bf16_decode import CODE_BITS, Compressed, Layout, pad_payload
from jfire.kernels.layer_weights import CodedBlocks, FusedPalette, decode, default_decoder, fused_rows
from jfire.kernels.palette_matmul import Palette, PaletteLayout, flat, pad_exceptions
from jfire.models.family import Family
from jfire.models.params import get_path, set_path
from jfire.sharding import RULES, to_host

FORMAT_VERSION = 2
CODEC = "bf16-exponent-huffman"
CODEC_VERSION = 1
# Checkpoints with palette-coded tensors (and maybe Huffman-coded ones beside them).
MIXED_CODEC = "bf16-exponent"
MIXED_CODEC_VERSION = 2
PALETTE_VERSION = 1
CODECS = ("huffman", "palette", "auto")
# auto: palette where the fused matmul serves the tensor, unless it is this much (a fraction of
# the bf16 size) larger than Huffman; elsewhere the smaller of the two.
AUTO_MARGIN = 0.10
# Logical axes a mesh may shard (jfire.sharding's rules) become the rows of the encode
# layout, so that every shard is a set of whole rows (docs/compression.md). The layout is
# recorded per tensor, so later rule changes do not affect existing checkpoints.
SHARDABLE_AXES = tuple(name for name, rule in RULES.items() if rule)
ARRAYS = ("code_lengths", "lane_bits", "raw", "payload")
PALETTE_ARRAYS = ("codes", "raw", "palette", "exc_start", "exc_pos", "exc_exp")


def layout_for(spec) -> Layout:
    """A ParamSpec's layout: layers are units; sharded axes, in order, are rows; the rest columns."""
    unit = 1 if spec.per_layer else 0
    rest = range(unit, len(spec.shape))
    rows = [a for a in rest if spec.axes[a] in SHARDABLE_AXES]
    cols = [a for a in rest if spec.axes[a] not in SHARDABLE_AXES]
    return codec.make_layout(spec.shape, (0,) * unit + tuple(rows) + tuple(cols), unit, len(rows))


def palette_layout_for(spec) -> PaletteLayout:
    """A ParamSpec's palette layout: layers (and experts) are units; a linear layer's inputs
    are the rows (the matmul's K), its outputs the columns; other tensors split after their
    first axis. The tensor keeps its own axis order."""
    from jfire.checkpoint import palette

    units = (1 if spec.per_layer else 0) + (1 if spec.per_expert else 0)
    return palette.make_layout(spec.shape, units, spec.n_in)


def serves_fused(spec) -> bool:
    """Whether the fused palette matmul can multiply by this weight: a linear layer (inputs
    first). Expert stacks go through the grouped matmuls instead."""
    return spec.n_in is not None and not spec.per_expert and spec.dtype is None


def path_of(spec, stored: str) -> str:
    """How a stored tensor reaches its use: 'fused' (the palette matmul reads it), 'decode'
    (decoded to bf16 first) or 'plain'."""
    if stored == "raw":
        return "plain"
    return "fused" if stored == "palette" and serves_fused(spec) else "decode"


def encode_tensor(
    value: np.ndarray, codec_name: str, layout: Layout, palette_layout: PaletteLayout, fused: bool
) -> Compressed | Palette | None:
    """`value` (bf16 bits) coded by `codec_name` (huffman, palette or auto), or None to store it
    raw. auto: palette when the fused matmul serves the tensor and it costs at most AUTO_MARGIN
    (of bf16) more than Huffman; otherwise the smaller of the two (both are decoded before use)."""
    from jfire.checkpoint import palette

    if codec_name == "huffman":
        return codec.maybe_encode(value, layout)
    if codec_name == "palette":
        return palette.maybe_encode(value, palette_layout)
    if codec_name != "auto":
        raise JfireError(f"unknown codec {codec_name!r}; use one of: {', '.join(CODECS)}")
    h = codec.maybe_encode(value, layout)
    p = palette.maybe_encode(value, palette_layout)
    if p is None or h is None:
        return p or h
    return p if p.nbytes <= h.nbytes + (AUTO_MARGIN * value.nbytes if fused else 0) else h


def compress_params(config, params: dict, progress=None, codec_name: str = "huffman") -> tuple[dict, dict]:
    """(the tree orbax saves, the manifest's "compression" section) for bf16 params, each
    tensor coded by `codec_name`: huffman, palette or auto (per tensor, see AUTO_MARGIN)."""
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
        c = encode_tensor(value, codec_name, layout_for(spec), palette_layout_for(spec), serves_fused(spec))
        if c is None:
            set_path(tree, spec.name, value.view(ml_dtypes.bfloat16))
            entry.update(stored="raw", bytes=value.nbytes)
        elif isinstance(c, Palette):
            set_path(tree, spec.name, {name: getattr(c, name) for name in PALETTE_ARRAYS})
            coded = {"stored": "palette", "layout": c.layout.to_dict(), "exceptions": c.exceptions, "bytes": c.nbytes}
            tensors[spec.name] = {**entry, **coded}
            if progress:
                progress(spec.name)
            continue
        else:
            set_path(tree, spec.name, {name: getattr(c, name) for name in ARRAYS})
            entry.update(
                stored="huffman", layout=c.layout.to_dict(), payload_words=int(c.payload.shape[0]), bytes=c.nbytes
            )
        tensors[spec.name] = entry
        if progress:
            progress(spec.name)
    if any(t["stored"] == "palette" for t in tensors.values()):
        head = {"codec": MIXED_CODEC, "codec_version": MIXED_CODEC_VERSION, "code_bits": CODE_BITS,
                "palette_version": PALETTE_VERSION}  # fmt: skip
    else:
        head = {"codec": CODEC, "codec_version": CODEC_VERSION, "code_bits": CODE_BITS}
    return tree, {**head, "tensors": tensors}


def is_compressed(manifest: dict) -> bool:
    return manifest.get("format") == FORMAT_VERSION


def check_section(path: Path, manifest: dict, specs) -> dict:
    """The manifest's compression section, refused unless this jfire reads it and it covers the model."""
    section = manifest.get("compression")
    if not isinstance(section, dict) or not isinstance(section.get("tensors"), dict):
        raise JfireError(
            f"{path}/jfire.json is a compressed checkpoint without its 'compression' section; convert again"
        )
    head = (section.get("codec"), section.get("codec_version"), section.get("code_bits"))
    if head == (CODEC, CODEC_VERSION, CODE_BITS):
        kinds: tuple[str, ...] = ("raw", "huffman")
    elif head == (MIXED_CODEC, MIXED_CODEC_VERSION, CODE_BITS) and section.get("palette_version") == PALETTE_VERSION:
        kinds = ("raw", "huffman", "palette")
    else:
        raise JfireError(
            f"{path} is compressed with codec {section.get('codec')!r} version {section.get('codec_version')!r}; "
            f"this jfire reads {CODEC!r} version {CODEC_VERSION} and {MIXED_CODEC!r} version "
            f"{MIXED_CODEC_VERSION} (palette version {PALETTE_VERSION}) (convert the model again)"
        )
    for spec in specs:
        entry = section["tensors"].get(spec.name)
        try:
            assert entry["stored"] in kinds and isinstance(entry["checksum"], int)
            shape = spec.shape
            if entry["stored"] == "huffman":
                shape = Layout.from_dict(entry["layout"]).shape
                assert isinstance(entry["payload_words"], int)
            elif entry["stored"] == "palette":
                shape = PaletteLayout.from_dict(entry["layout"]).shape
                assert isinstance(entry["exceptions"], int) and entry["exceptions"] >= 0
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
        if entry["stored"] == "palette":
            shapes = PaletteLayout.from_dict(entry["layout"]).shapes(int(entry["exceptions"]))
            set_path(
                tree, spec.name, {k: jax.ShapeDtypeStruct(s, d, sharding=sharding) for k, (s, d) in shapes.items()}
            )
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


@functools.partial(jax.jit, static_argnames=("decoder", "shape"))
def _decode_palette(p: Palette, decoder: str, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    values = decode(p, decoder).reshape(shape)
    return values, device_checksum(values)


def decode_palette_checked(p: Palette, decoder: str) -> tuple[jax.Array, jax.Array]:
    """(bf16 values, their checksum), both on the device, of a palette-coded tensor. Decoded as
    [units, rows, cols] with its exception lists padded to a power of two: tensors of one
    layout share a compiled decoder (compiling costs more than decoding in interpret mode)."""
    padded = pad_exceptions(flat(p), 1 << p.exceptions.bit_length())
    return _decode_palette(padded, decoder, p.layout.shape)


def check_palette_tables(path: Path, name: str, p: Palette) -> None:
    """Refuses exception offsets that do not run from 0 to the list's end in order, and
    positions outside their tile: the decoders would survive them, but they must not load."""
    start = np.asarray(p.exc_start).astype(np.int64)
    lay = p.layout
    pos = np.asarray(p.exc_pos)[:-1]
    if (
        start[0] != 0
        or start[-1] != p.exceptions
        or np.any(np.diff(start) < 0)
        or np.any(pos >= lay.tile_rows * lay.tile_cols)
    ):
        raise JfireError(
            f"{path}: tensor '{name}' has invalid exception lists; the checkpoint is corrupt (convert the model again)"
        )


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
    path: Path,
    specs,
    section: dict,
    stored: dict,
    dtype,
    decoder: str,
    keep_compressed: bool = False,
    shardings: dict | None = None,
    keep=lambda spec: True,
) -> dict:
    """Decodes every restored tensor on its device and checks it against the manifest. With
    `shardings` (the stored arrays then on the host) each device decodes only its own block
    (`_decode_on_mesh`). `keep`: which layer stacks `keep_compressed` may keep coded."""
    params: dict = {}
    checksums = {}
    for spec in specs:
        leaf = get_path(stored, spec.name)
        entry = section["tensors"][spec.name]
        place = None if shardings is None else get_path(shardings, spec.name)
        kept: Compressed | Palette | CodedBlocks | None = None
        if entry["stored"] == "raw":
            value = leaf if place is None else jax.device_put(np.asarray(leaf), place)
            checksums[spec.name] = device_checksum(value)
        elif place is None:
            kept = _read_coded(path, spec.name, entry, leaf)
            value, checksums[spec.name] = _decode_whole(kept, decoder)
        else:
            coded = _read_coded(path, spec.name, entry, leaf)
            value, checksums[spec.name], kept = _decode_on_mesh(coded, place, decoder)
        set_path(stored, spec.name, None)  # freed as decoded: device memory stays near the decoded size
        if keep_compressed and spec.per_layer and kept is not None and keep(spec):
            set_path(params, spec.name, kept)
        else:
            set_path(params, spec.name, value.astype(spec.dtype or dtype))
    for name, checksum in checksums.items():
        checksum = to_host(checksum)  # (replicated over a group's processes, each holds it whole)
        want = section["tensors"][name]["checksum"]
        if int(checksum) != want:
            raise JfireError(
                f"{path}: tensor '{name}' fails its checksum (stored {want:#010x}, decoded "
                f"{int(checksum):#010x}); the checkpoint is corrupt (convert the model again)"
            )
    return params


def _read_coded(path: Path, name: str, entry: dict, leaf: dict) -> Compressed | Palette:
    """A restored coded tensor as its codec's pytree, its tables checked."""
    if entry["stored"] == "palette":
        pal = Palette(layout=PaletteLayout.from_dict(entry["layout"]), **{k: leaf[k] for k in PALETTE_ARRAYS})
        check_palette_tables(path, name, pal)
        return pal
    huff = Compressed(layout=Layout.from_dict(entry["layout"]), **{k: leaf[k] for k in ARRAYS})
    check_tables(path, name, huff)
    return huff


def _decode_whole(coded: Compressed | Palette, decoder: str) -> tuple[jax.Array, jax.Array]:
    if isinstance(coded, Palette):
        return decode_palette_checked(coded, decoder)
    return decode_checked(coded, decoder)


def _decode_on_mesh(coded: Compressed | Palette, sharding, decoder: str):
    """(bf16 values placed by `sharding`, their checksum, the coded blocks or None) for a coded
    tensor read on the host: each device is sent its own block, coded, and decodes it. A
    palette tensor whose shards cut its tiles is decoded on one of this process's devices of
    the mesh and placed (its blocks None: it cannot stay coded)."""
    blocks = coded_shards.blocks_of(sharding, coded.layout.shape)
    pieces = coded_shards.cut(coded, blocks)
    if pieces is None:
        local = next(d for d in sharding.mesh.devices.flat if d.process_index == jax.process_index())
        value, checksum = decode_palette_checked(jax.device_put(coded, local), decoder)
        return jax.device_put(np.asarray(value), sharding), checksum, None
    placed = coded_shards.place(pieces, blocks, sharding)
    value = jax.device_put(_decode_placed(placed, decoder), sharding)  # in place: names the spec as given
    return value, device_checksum(value), placed


@functools.partial(jax.jit, static_argnames=("decoder",))
def _decode_placed(blocks: CodedBlocks, decoder: str) -> jax.Array:
    return decode(blocks, decoder)


# -- keeping layers compressed ------------------------------------------------------------------------


def _words(value: np.ndarray) -> np.ndarray:
    """The 16-bit words `device_checksum` sums for a param held in its own dtype: a 4-byte
    array's in memory order (as the device's bitcast splits them); FP8 codes as the bf16 values
    they equal exactly."""
    if value.dtype.itemsize == 1:
        return codec.as_bits(np.ascontiguousarray(value))
    return np.ascontiguousarray(value).view(np.uint16)


def fuse_layers(params: dict, config, dtype, max_rows: int | None = None) -> dict:
    """`params` with each kept palette-coded linear layer stack (`serves_fused`) marked for the
    fused matmul (`FusedPalette`) up to `max_rows` rows of x, or up to the rows measured on
    this device for its layout (`fused_rows`; a stack the fused matmul never wins on stays
    decoded per layer)."""
    measured: dict = {}
    out = jax.tree.map(lambda x: x, params, is_leaf=lambda x: isinstance(x, (Compressed, Palette)))
    for spec in config.param_specs():
        leaf = get_path(params, spec.name)
        if not (isinstance(leaf, Palette) and spec.per_layer and serves_fused(spec)):
            continue
        rows = max_rows
        if rows is None:
            if leaf.layout not in measured:
                measured[leaf.layout] = fused_rows(leaf, dtype)
            rows = measured[leaf.layout]
        if rows:
            set_path(out, spec.name, FusedPalette(leaf, rows))
    return out


def compressed_bytes(params: dict) -> int:
    """Device bytes held by a params tree, counting compressed leaves at their stored size."""
    coded = (Compressed, Palette, CodedBlocks, FusedPalette)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, coded))
    return sum(leaf.nbytes if isinstance(leaf, coded) else leaf.size * leaf.dtype.itemsize for leaf in leaves)


def ratio(section: dict) -> float:
    tensors = section["tensors"].values()
    return sum(t["bytes"] for t in tensors) / max(1, sum(t["original_bytes"] for t in tensors))


# -- saving and restoring -----------------------------------------------------------------------------


def save(dst: Path, config, params: dict, progress=None, codec_name: str = "huffman") -> dict:
    """Writes a compressed checkpoint of bf16 `params` (host or device arrays) into dst, coded
    by `codec_name` (huffman, palette or auto); returns the compression section written to the
    manifest."""
    tree, section = compress_params(config, params, progress, codec_name)
    store.save(dst, config, tree, "bfloat16", compression=section)
    return section


def restore(
    path: Path, manifest: dict, dtype, *, decoder: str | None = None, keep_compressed: bool = False, shardings=None
) -> tuple[Family, dict]:
    """Config and params of a compressed checkpoint, decoded on the device and checked.

    With `shardings` the stored arrays are read on the host and each device is sent and
    decodes only its own block of every tensor (jfire.checkpoint.coded_shards); kept
    compressed, layer stacks stay as those per-device blocks (`CodedBlocks`).
    """
    path = Path(path).absolute()
    config = store.config_of(manifest)
    store.check_layer_stacks(path, manifest, config)
    specs = config.param_specs()
    section = check_section(path, manifest, specs)
    if shardings is None:
        where = jax.local_devices()[0]
        keep = lambda spec: True  # noqa: E731
    else:
        where = _host_device()
        mesh = next(iter(jax.tree.leaves(shardings))).mesh
        # Where tp repeats the KV heads (sharding.adapt_to_mesh), their weights are repeated
        # decoded: coded blocks cannot be.
        repeats = config.adapt_to_tp(mesh.shape["tp"])[1] > 1
        keep = lambda spec: not (repeats and "kv_heads" in spec.axes)  # noqa: E731
    target = abstract_tree(specs, section, jax.sharding.SingleDeviceSharding(where))
    stored = _read_stored(path, specs, target)
    params = decode_tree(
        path, specs, section, stored, dtype, decoder or default_decoder(), keep_compressed, shardings, keep
    )
    return config, params


def _host_device():
    """Where stored arrays are read before being cut into per-device blocks on the host: the
    CPU backend's device, or the first local device where JAX runs without one."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


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
