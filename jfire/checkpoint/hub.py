"""`--model org/name`: a Hugging Face id, found in the local Hugging Face cache.

A model downloaded with `hf download org/name` (or by transformers or vLLM) lies in the hub's
cache as `models--org--name/snapshots/<commit>/`, `refs/main` naming the commit. This module
finds that snapshot directory the way huggingface_hub does (its `snapshot_download` with
`local_files_only=True`, so nothing is ever fetched) and hands it on as a model directory.
A path that exists always wins over an id.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jfire.errors import JfireError

# huggingface_hub's repo-id rules, in short: `org/name`, letters, digits, `-`, `_` and `.`,
# no `--` or `..`, neither end a `-` or `.`, at most 96 characters.
_PART = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_PART}/{_PART}$")


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub uses, read from the environment now (not when the library
    was imported): $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
        )
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def is_repo_id(model: str) -> bool:
    """Whether `model` reads as a Hugging Face id (`org/name`), not as a path."""
    return (
        bool(_REPO_ID.match(model))
        and len(model) <= 96
        and "--" not in model
        and ".." not in model
        and not model.lower().endswith((".gguf", ".git"))
    )


def resolve_source(model: str) -> Path:
    """The local path `model` names: itself if it exists (or cannot be an id), else the
    snapshot directory of the Hugging Face id in the local cache (JfireError if it is not there)."""
    path = Path(model).expanduser()
    if path.exists() or not is_repo_id(model):
        return path
    return snapshot_dir(model)


def snapshot_dir(repo_id: str) -> Path:
    """The cached snapshot of `repo_id` (its `main`), found without a network."""
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (OSError, ValueError) as e:  # LocalEntryNotFoundError (an OSError), HFValidationError (a ValueError)
        raise JfireError(_not_cached(repo_id, cache, e)) from None


def cached_repo_ids(cache: Path) -> list[str]:
    """The model ids the cache holds, sorted."""
    if not cache.is_dir():
        return []
    return sorted(
        d.name.removeprefix("models--").replace("--", "/")
        for d in cache.iterdir()
        if d.name.startswith("models--") and d.is_dir()
    )


def _not_cached(repo_id: str, cache: Path, error: Exception) -> str:
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    if folder.is_dir():
        found = f"{folder} is there but has no usable snapshot of main ({' '.join(str(error).split())})"
    elif cache.is_dir():
        held = cached_repo_ids(cache)
        listed = ", ".join(held[:8]) + (f" and {len(held) - 8} more" if len(held) > 8 else "")
        found = f"there is no {folder.name} in {cache} (it holds {listed or 'no models'})"
    else:
        found = f"the cache directory {cache} does not exist"
    return (
        f"model {repo_id!r} is not a local path, and the Hugging Face cache has no copy of it: {found}. "
        f"jfire does not download: on a machine with network run `hf download {repo_id}` and copy its "
        f"hub cache here (set HF_HUB_CACHE or HF_HOME to where it lies), or pass a local HF model "
        "directory, a .gguf file or a checkpoint made with `jfire convert`"
    )
