"""torchvision for the HF image processors the vision tests compare against, and only for them.

scripts/setup.sh --test installs torchvision 0.28.0 (the release matching torch 2.13) without
its dependencies into .venv/torchvision-reference. The wheels available are CUDA builds, whose
compiled ops fail to register beside the CPU torch; the processors' resizing, cropping and
normalising are pure torch, so the module that registers those ops is replaced by an empty one
before torchvision is imported. Call `import_torchvision()`, then import an image processor from its own module
(`transformers.models.llama4.image_processing_llama4`): the names at `transformers`' top level
are bound when transformers is first imported, to stand-ins where torchvision was missing.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[2] / ".venv" / "torchvision-reference"


def import_torchvision():
    """torchvision, importable by transformers' image processors from here on."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    if not (FOLDER / "torchvision").is_dir():
        pytest.fail(f"no torchvision at {FOLDER}: run `bash scripts/setup.sh --test`")
    sys.path.insert(0, str(FOLDER))
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    import torchvision

    # transformers asks once whether torchvision is installed and remembers the answer: where it
    # was imported before this (another test module in the same process), it remembered no.
    from transformers.utils import import_utils

    for check in (import_utils.is_torchvision_available, import_utils.is_torchvision_v2_available):
        check.cache_clear()
    return torchvision
