"""`--mesh` and `--cpu-devices` from the command line: the same greedy tokens as one device,
and a mesh that does not fit is refused with the reason and what would fit."""

from __future__ import annotations

import json
import subprocess
import sys


def generate(*args: str) -> subprocess.CompletedProcess:
    """`jfire generate` of a tiny model: compiled quickly (--quick-compile), as it runs a few tokens."""
    return subprocess.run([sys.executable, "-m", "jfire.cli", "generate", "--json", "--compile-cache", "off",
                           "--quick-compile", *args],
                          capture_output=True, text=True, timeout=600)


def test_generate_on_a_mesh_file_equals_one_device(tiny_hf_dir, tmp_path):
    model = str(tiny_hf_dir("llama2"))  # 2 layers, 4 heads, 2 KV heads
    mesh = tmp_path / "pp2-tp4.toml"
    mesh.write_text('name = "pp2-tp4"\n\n[mesh]\npp = 2\ntp = 4\n\n[pipeline]\nmicrobatches = 2\n')
    args = ["--model", model, "--prompt-ids", "5,6,7,8,9", "--max-tokens", "8"]
    single = generate(*args)
    meshed = generate(*args, "--cpu-devices", "8", "--mesh", str(mesh))
    assert single.returncode == 0 and meshed.returncode == 0, single.stderr + meshed.stderr
    assert json.loads(meshed.stdout)["token_ids"] == json.loads(single.stdout)["token_ids"]


def test_a_mesh_that_does_not_fit_is_refused(tiny_hf_dir):
    run = generate("--model", str(tiny_hf_dir("llama2")), "--prompt-ids", "5", "--cpu-devices", "8",
                   "--mesh", "pp=4,tp=3")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("jfire: error: mesh 'pp=4,tp=3' does not fit")
    assert "more stages than the 2 layers" in line and "tp=3 does not divide the 4 attention heads" in line
    assert "Would fit: " in line and "pp=2,tp=4" in line
