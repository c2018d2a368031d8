"""The builds of jfire's CPU kernel library (jfire.kernels.cpu_matmul, cpu_attention) that the
kernel tests run over: a test that takes `kernel_build` runs once on each.

- native: this machine's library, the one the engine loads (`cpu_matmul.available()`: $CXX,
  else g++, for -march=native; AVX-512 where the CPU has it);
- avx2: g++ for x86-64-v3 (AVX2 and FMA, no AVX-512), so an AVX-512 machine runs the 8-lane
  branches too (its bits differ from the 16-lane build's by construction, its bounds do not);
- clang: clang++ for -march=native (scripts/setup.sh --test installs clang).

Each is built once into the kernels' build directory, keyed by sources, flags, compiler and
CPU (a later run loads it), and registered under target names of its own
(`cpu_matmul.library`), so all three live in one process.
"""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest

from jfire.kernels import cpu_matmul

BUILDS = {"native": {}, "avx2": {"compiler": "g++", "march": "x86-64-v3"}, "clang": {"compiler": "clang++"}}


@pytest.fixture(scope="module", params=list(BUILDS))
def kernel_library(request):
    """(name, the library's path) of one build, built if need be."""
    name, how = request.param, BUILDS[request.param]
    if name == "native":
        assert cpu_matmul.available(), "the CPU kernels did not build (see the warning above)"
        return name, cpu_matmul.build()
    if name == "avx2" and not (platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= cpu_flags()):
        pytest.skip("an AVX2 build runs only on an x86-64 CPU with AVX2 and FMA")
    if shutil.which(how["compiler"]) is None:
        pytest.skip(f"{how['compiler']} is not installed (scripts/setup.sh --test installs clang)")
    return name, cpu_matmul.build(**how)


@pytest.fixture
def kernel_build(kernel_library):
    """The build's name; the kernels the test traces are that build's."""
    name, path = kernel_library
    if name == "native":
        yield name
        return
    with cpu_matmul.library(path):
        yield name


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.partition(":")[2].split()}
