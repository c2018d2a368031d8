"""File names a checkpoint gives about itself, kept inside the checkpoint.

A checkpoint is often downloaded from strangers, and some of its files name others (a sharded
model's `model.safetensors.index.json` maps each tensor to the shard that holds it). Such a name
is only ever a file of the checkpoint's own directory: an absolute name or one that climbs out
with `..` would have jfire open whatever file it points at (a device, another user's file), so
it is refused before anything is opened.

The check is on the name, not on where the filesystem's links lead: the Hugging Face cache keeps
a snapshot's files as symlinks into its `blobs/` folder, outside the snapshot directory, and a
link is something whoever owns the filesystem made, not something a downloaded file can say.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

from jfire.errors import JfireError

WEIGHT_INDEX = "model.safetensors.index.json"


def file_in(directory: Path, name: object, source: Path, entry: str) -> Path:
    """`directory / name`, for a file name read from the checkpoint file `source` (at `entry`,
    which the error names); refused unless it is a relative name that stays in `directory`."""
    where = f"{source}: {entry}"
    if not isinstance(name, str) or not name:
        raise JfireError(f"{where} must be a file name (a non-empty string), not {name!r}")
    if "\0" in name:
        raise JfireError(f"{where} is {name!r}, which holds a NUL character; a file name cannot")
    pure = PurePosixPath(name)
    if pure.is_absolute():
        raise JfireError(
            f"{where} is {name!r}, an absolute path; a checkpoint names only files of its own directory "
            f"({directory}), relative to it"
        )
    if ".." in pure.parts:
        raise JfireError(
            f"{where} is {name!r}, which climbs out of the checkpoint's directory ({directory}) with '..'; "
            "a checkpoint names only files of its own directory"
        )
    joined = Path(directory) / name
    # Belt and braces: whatever the name's spelling, its normal form stays under the directory.
    base = os.path.normpath(os.path.abspath(directory))
    if os.path.commonpath([base, os.path.normpath(os.path.abspath(joined))]) != base:
        raise JfireError(f"{where} is {name!r}, which lies outside the checkpoint's directory ({directory})")
    return joined


def read_weight_map(directory: Path, index: Path | None = None) -> dict[str, Path]:
    """Tensor name -> shard file, from a sharded model's index (`model.safetensors.index.json`
    in `directory` unless `index` is given), every shard checked to be a file of `directory`."""
    directory = Path(directory)
    index = directory / WEIGHT_INDEX if index is None else Path(index)
    try:
        content = json.loads(index.read_text())
    except json.JSONDecodeError as e:
        raise JfireError(f"{index} is not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JfireError(f"cannot read {index}: {e}") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        raise JfireError(f"{index} has no 'weight_map' object (tensor name -> shard file name)")
    return {name: file_in(directory, file, index, f"weight_map[{name!r}]") for name, file in weight_map.items()}
