"""`jfire compress-report`: how far the codec compresses any weights, checked bit for bit.

Reads a .safetensors file, a directory of them (a HF model of any architecture), a .gguf
file (dequantized), a jfire checkpoint, a Hugging Face id in the local cache (`org/name`) or
`default`. Float tensors are cast to bf16 and compressed in memory by the codec asked for
(huffman, palette or auto); a compressed checkpoint is decoded and checked against its stored
checksums instead. Every figure counts all tables, lane lengths, palettes, exceptions and
padding. Each tensor's path says how it reaches its use: `fused` (the palette matmul reads it
coded), `decode` (decoded to bf16 first) or `plain` (stored raw).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jfire.checkpoint import codec, compressed, hub, palette, store
from jfire.errors import JfireError
from jfire.kernels.bf16_decode import Layout
from jfire.kernels.palette_matmul import Palette, PaletteLayout


@dataclasses.dataclass
class TensorReport:
    name: str
    shape: tuple[int, ...]
    source_dtype: str
    stored: str  # the codec: "huffman", "palette" or "raw"
    path: str  # "fused", "decode" or "plain" (compressed.path_of)
    k: int | None  # palette code bits
    original_bytes: int  # as bf16
    bytes: int
    exponent_entropy: float  # bits per value: the order-0 limit for the exponent (per coded unit)
    exponent_bits: float | None  # what the code spends per exponent, payload only
    round_trip: bool

    @property
    def values(self) -> int:
        return math.prod(self.shape)

    @property
    def ratio(self) -> float:
        return self.bytes / max(1, self.original_bytes)


def report(
    path: str, decoder: str = "reference", progress: Callable | None = None, codec_name: str = "huffman"
) -> dict:
    """Per-tensor reports and totals, as a JSON-ready dict."""
    histogram = np.zeros(codec.SYMBOLS, np.int64)
    tensors = []
    for item, hist in _reports(path, decoder, codec_name):
        tensors.append(item)
        histogram += hist
        if progress:
            progress(item.name)
    if not tensors:
        raise JfireError(f"{path} holds no float tensors to compress")
    values = sum(t.values for t in tensors)
    original = sum(t.original_bytes for t in tensors)
    total = {
        "tensors": len(tensors),
        "values": values,
        "original_bytes": original,
        "bytes": sum(t.bytes for t in tensors),
        "ratio": sum(t.bytes for t in tensors) / max(1, original),
        "exponent_entropy_pooled": codec.entropy_bits(histogram),
        "exponent_entropy": sum(t.exponent_entropy * t.values for t in tensors) / max(1, values),
        "entropy_limit_ratio": sum((8 + t.exponent_entropy) * t.values for t in tensors) / max(1, 16 * values),
        "round_trip": all(t.round_trip for t in tensors),
        "codecs": {kind: sum(t.stored == kind for t in tensors) for kind in ("huffman", "palette", "raw")},
        "paths": {kind: sum(t.path == kind for t in tensors) for kind in ("fused", "decode", "plain")},
    }
    return {
        "source": str(path),
        "decoder": decoder,
        "codec": codec_name,
        "tensors": [{**dataclasses.asdict(t), "ratio": t.ratio} for t in tensors],
        "total": total,
    }


def _reports(model: str, decoder: str, codec_name: str) -> Iterator[tuple[TensorReport, np.ndarray]]:
    if model == "default":
        from jfire.checkpoint.default_model import ensure_default_checkpoint

        path = ensure_default_checkpoint()
    else:
        path = hub.resolve_source(model)
    if not path.exists():
        raise JfireError(
            f"{str(path)!r} does not exist (give a .safetensors file, a HF directory, a .gguf file, "
            "a jfire checkpoint or 'default')"
        )
    if store.is_checkpoint(path):
        manifest = store.read_manifest(path)
        if compressed.is_compressed(manifest):
            yield from _stored_reports(path, manifest, decoder)
            return
    for name, value, source_dtype, spec in tensors_and_specs(path):
        yield _measure(name, value, source_dtype, spec, decoder, codec_name)


def _histograms(bits: np.ndarray, layout) -> tuple[np.ndarray, float]:
    """(exponent counts, entropy): the entropy is the mean over the separately coded units
    (layers of a stacked weight), the order-0 limit for a code built per unit."""
    per_unit = codec.unit_histograms(codec.exponents(bits.transpose(layout.perm)), layout)
    entropy = sum(codec.entropy_bits(h) * h.sum() for h in per_unit) / max(1, bits.size)
    return per_unit.sum(axis=0), entropy


def layouts_for(shape, spec) -> tuple[Layout, PaletteLayout, bool]:
    """(Huffman layout, palette layout, whether the fused matmul serves it): from the model's
    declaration in a jfire checkpoint; for a file, any matrix counts as served (conversion
    puts a linear layer's inputs first)."""
    if spec is not None:
        return compressed.layout_for(spec), compressed.palette_layout_for(spec), compressed.serves_fused(spec)
    return codec.make_layout(shape), palette.make_layout(shape), len(shape) >= 2


def _palette_bits(p: Palette) -> float:
    """What the palette code spends per exponent: codes, palettes and exceptions."""
    return 8 * (p.nbytes - p.raw.size) / p.raw.size


def _measure(name, value, source_dtype, spec, decoder, codec_name) -> tuple[TensorReport, np.ndarray]:
    bits = codec.as_bits(value)
    layout, palette_layout, fused = layouts_for(bits.shape, spec)
    hist, entropy = _histograms(bits, layout)
    c = compressed.encode_tensor(bits, codec_name, layout, palette_layout, fused)
    ok, exponent_bits, stored, k = True, None, "raw", None
    if isinstance(c, Palette):
        decoded, _ = compressed.decode_palette_checked(c, decoder)
        stored, k, exponent_bits = "palette", c.layout.k, _palette_bits(c)
    elif c is not None:
        decoded, _ = compressed.decode_checked(c, decoder)
        stored, exponent_bits = "huffman", 32 * (c.payload.shape[0] - 1) / bits.size
    if c is not None:
        ok = bool(np.array_equal(np.asarray(decoded).view(np.uint16), bits))
    item = TensorReport(
        name=name,
        shape=tuple(bits.shape),
        source_dtype=source_dtype,
        stored=stored,
        path="plain" if c is None else "fused" if stored == "palette" and fused else "decode",
        k=k,
        original_bytes=bits.nbytes,
        bytes=c.nbytes if c is not None else bits.nbytes,
        exponent_entropy=entropy,
        exponent_bits=exponent_bits,
        round_trip=ok,
    )
    return item, hist


def _stored_reports(path: Path, manifest: dict, decoder: str) -> Iterator[tuple[TensorReport, np.ndarray]]:
    """A compressed checkpoint: decoding it checks every tensor against its stored checksum."""
    from jfire.models.params import get_path

    config, params = compressed.restore(path, manifest, jnp.bfloat16, decoder=decoder)
    entries = manifest["compression"]["tensors"]
    for spec in config.param_specs():
        bits = np.asarray(get_path(params, spec.name)).view(np.uint16)
        hist, entropy = _histograms(bits, compressed.layout_for(spec))
        entry = entries[spec.name]
        words = entry.get("payload_words")
        exponent_bits, k = (32 * (words - 1) / bits.size if words else None), None
        if entry["stored"] == "palette":
            k = PaletteLayout.from_dict(entry["layout"]).k
            exponent_bits = 8 * (entry["bytes"] - bits.size) / bits.size
        yield (
            TensorReport(
                name=spec.name,
                shape=spec.shape,
                source_dtype="bfloat16",
                stored=entry["stored"],
                path=compressed.path_of(spec, entry["stored"]),
                k=k,
                original_bytes=entry["original_bytes"],
                bytes=entry["bytes"],
                exponent_entropy=entropy,
                exponent_bits=exponent_bits,
                round_trip=True,
            ),
            hist,
        )


def tensors_of(path: Path) -> Iterator[tuple[str, np.ndarray, str, object]]:
    """(name, values, source dtype, Huffman layout) of every float tensor under `path`."""
    for name, value, source_dtype, spec in tensors_and_specs(path):
        yield name, value, source_dtype, layouts_for(value.shape, spec)[0]


def tensors_and_specs(path: Path) -> Iterator[tuple[str, np.ndarray, str, object]]:
    """(name, values, source dtype, ParamSpec or None) of every float tensor under `path`."""
    if store.is_checkpoint(path):
        from jfire.models.params import get_path

        config, params = store.restore(path, jnp.bfloat16)
        for spec in config.param_specs():
            value = np.asarray(get_path(params, spec.name))
            yield spec.name, value, store.read_manifest(path)["dtype"], spec
        return
    if path.is_file() and path.suffix.lower() == ".gguf":
        yield from _gguftensors_and_specs(path)
        return
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files or any(f.suffix != ".safetensors" for f in files):
        raise JfireError(f"{path} is not a .safetensors file, a directory of them, a .gguf file or a jfire checkpoint")
    for file in files:
        yield from _safetensorstensors_and_specs(file, prefix=f"{file.name}:" if len(files) > 1 else "")


def _safetensorstensors_and_specs(file: Path, prefix: str):
    from safetensors import safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                value = f.get_tensor(name)
                if np.issubdtype(value.dtype, np.floating) or value.dtype.name == "bfloat16":
                    yield prefix + name, value, value.dtype.name, None
    except JfireError:
        raise
    except Exception as e:
        raise JfireError(f"{file} is not a readable safetensors file ({e}); it may be truncated or corrupt") from None


def _gguftensors_and_specs(file: Path):
    import gguf

    try:
        reader = gguf.GGUFReader(file)
    except Exception as e:
        raise JfireError(f"{file} is not a readable GGUF file ({e})") from None
    for t in reader.tensors:
        value = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        value = value.reshape(tuple(reversed([int(n) for n in t.shape])))
        yield t.name, value, t.tensor_type.name, None


def format_table(rep: dict) -> str:
    """The report as a readable table plus totals."""
    w = min(64, max(len("tensor"), *(len(t["name"]) for t in rep["tensors"])))
    lines = [
        f"{'tensor':<{w}} {'shape':<20} {'stored':<7} {'path':<6} {'k':>2} {'MB':>8} {'ratio':>6} {'H(exp)':>6} "
        f"{'bits':>5} {'exact':>5}"
    ]
    for t in rep["tensors"]:
        bits = f"{t['exponent_bits']:.2f}" if t["exponent_bits"] is not None else "-"
        k = t.get("k") or "-"
        lines.append(
            f"{t['name'][-w:]:<{w}} {'x'.join(map(str, t['shape'])) or 'scalar':<20} {t['stored']:<7} "
            f"{t['path']:<6} {k:>2} {t['original_bytes'] / 1e6:>8.2f} {t['ratio']:>6.3f} "
            f"{t['exponent_entropy']:>6.3f} {bits:>5} {'yes' if t['round_trip'] else 'NO':>5}"
        )
    tot = rep["total"]
    codecs = ", ".join(f"{n} {kind}" for kind, n in tot["codecs"].items() if n)
    paths = ", ".join(f"{n} {kind}" for kind, n in tot["paths"].items() if n)
    lines += [
        "",
        "stored: the codec; path: fused (a matmul reads it coded), decode (decoded to bf16 first) or plain; "
        "k: palette code bits",
        "ratio: stored / bf16 bytes; H(exp): exponent entropy, bits; bits: what the code spends per exponent",
        f"codecs: {codecs}; paths: {paths}",
        f"{tot['tensors']} tensors, {tot['values']:,} values: {tot['original_bytes'] / 1e6:.2f} MB as bf16 -> "
        f"{tot['bytes'] / 1e6:.2f} MB compressed, ratio {tot['ratio']:.4f} (all tables and offsets counted)",
        f"exponent entropy {tot['exponent_entropy']:.3f} bits per value within each coded tensor or layer "
        f"({tot['exponent_entropy_pooled']:.3f} pooled over all); order-0 limit ratio {tot['entropy_limit_ratio']:.4f}",
        f"bit-exact round trip ({rep['decoder']} decoder): {'yes' if tot['round_trip'] else 'NO'}",
    ]
    return "\n".join(lines)
