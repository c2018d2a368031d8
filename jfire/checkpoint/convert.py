"""`jfire convert SRC DST`: a HF directory or GGUF file into a jfire checkpoint."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

from jfire.checkpoint import store
from jfire.checkpoint.read import count_source_tensors, open_source, parse_dtype, read_params, tokenizer_of
from jfire.errors import JfireError


def convert(
    src: Path, dst: Path, dtype: str = "bfloat16", *, progress: bool = True, compress: bool | str = False
) -> Path:
    """Writes the checkpoint into a temporary sibling and renames it into place, so an
    interrupted conversion never leaves a half-written checkpoint that looks complete.
    `compress` stores the bf16 weights losslessly compressed (jfire.checkpoint.compressed):
    True or "huffman", "palette" (random-access codes the fused matmul reads) or "auto" (per
    tensor)."""
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    target = parse_dtype(dtype)
    codec_name = "huffman" if compress is True else compress or None
    if codec_name not in (None, "huffman", "palette", "auto"):
        raise JfireError(f"unknown --compress codec {codec_name!r}; use huffman, palette or auto")
    if compress and dtype != "bfloat16":
        raise JfireError(f"--compress stores bfloat16 weights; it cannot be combined with --dtype {dtype}")
    if store.is_checkpoint(src):
        raise JfireError(f"{src} is already a jfire checkpoint; give a HF directory or a .gguf file")
    if dst.exists() and any(dst.iterdir()):
        raise JfireError(f"destination {dst} exists and is not empty; choose a new directory or remove it")
    source = open_source(src)
    config = source.config
    bar = tqdm(total=count_source_tensors(config), desc=f"converting {src.name}", unit="tensor", disable=not progress)
    params = read_params(source, config, target, progress=lambda name: bar.update())
    bar.close()
    tokenizer = tokenizer_of(source)

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        if codec_name:
            from jfire.checkpoint import compressed

            compressed.save(staging, config, params, codec_name=codec_name)
        else:
            store.save(staging, config, params, dtype)
        if tokenizer is not None:
            tokenizer.save(staging)
        if dst.exists():
            dst.rmdir()
        staging.rename(dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dst
