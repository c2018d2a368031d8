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
    # was imported before this (in a pytest run always: tests/tiny_models.py, imported by
    # conftest, loads its image modules), it remembered no.
    from transformers.utils import import_utils

    for check in (import_utils.is_torchvision_available, import_utils.is_torchvision_v2_available):
        check.cache_clear()
    _bind_into_transformers()
    return torchvision


def _bind_into_transformers() -> None:
    """transformers' image modules bind their torchvision names when first imported: loaded
    before torchvision could be, image_processing_backends holds no `tvF` and a resampling map
    of None. They are bound here from a fresh execution of image_utils."""
    import importlib.util

    import transformers.image_processing_backends as backends
    import transformers.image_utils as image_utils

    if backends.pil_torch_interpolation_mapping is not None:
        return
    from torchvision.transforms.v2 import functional as tvF

    spec = importlib.util.find_spec("transformers.image_utils")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    for module in (image_utils, backends):
        module.pil_torch_interpolation_mapping = fresh.pil_torch_interpolation_mapping
        module.torch_pil_interpolation_mapping = fresh.torch_pil_interpolation_mapping
    backends.tvF = tvF
