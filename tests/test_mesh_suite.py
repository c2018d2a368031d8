"""Runs tests/mesh in a child pytest with 8 host devices (XLA fixes the device count when it
starts, so those tests cannot share this session). Its output is shown on failure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def test_mesh_suite_passes_on_eight_devices():
    root = Path(__file__).resolve().parents[1]
    # XLA's backend optimisation off (what `--quick-compile` sets for the engine's programs): the
    # suite's tiny models, and the default model's few tokens, take far longer to compile than
    # to run. Every program in it, references included, is compiled so.
    env = {**os.environ, "JFIRE_MESH_SESSION": "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"}
    # One process: this test already runs beside the main session's other worker.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                          str(root / "tests" / "mesh")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary and "failed" not in summary, summary
