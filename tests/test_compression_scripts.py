"""The compression benchmark and the prepared GPU check, run CPU-sized so they cannot rot
before a GPU runs them: both must report bit-exact decodes and write their JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # gpu_check imports bench_compression from beside it
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_smoke(tmp_path, capsys, monkeypatch):
    out = tmp_path / "gpu_check.json"
    assert load_script("gpu_check", monkeypatch).main(["--smoke", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["total"]["exact"] and result["total"]["ratio"] < 0.7
    assert {"reference_gbps", "pallas-interpret_gbps", "copy_gbps", "encode_gbps"} <= set(result["total"])
    assert [u["exact"] for u in result["units"]] == [True] * 2  # first and last layer of the stacked tensor
    assert len(result["sweep"]) == 2 and all(r["exact"] for r in result["sweep"])
    # The MoE layer: grouped (ragged_dot) and dense all-experts agree at every token count.
    assert [r["tokens"] for r in result["moe"]] == [1, 16, 256] and all(r["agree"] for r in result["moe"])
    # Compressed-resident layers (kept coded; fused, forced in interpret mode): their logits agree.
    coded = result["coded_layers"]
    assert [r["batch"] for r in coded] == [1, 16] and all(r["agree"] for r in coded)
    assert set(coded[0]["fused_max_rows"]) == {"layers.wq", "layers.wk", "layers.wv", "layers.wo", "layers.w_gate",
                                               "layers.w_up", "layers.w_down"}
    assert set(coded[0]["fused_max_rows"].values()) == {64} and coded[0]["kept_layer_bytes"] < coded[0]["plain_layer_bytes"]
    # The engine end to end (a tiny Llama, the Pallas attention interpreted): every measurement
    # taken, each decode batch without and with running ahead, the kernel equal to its reference.
    # One Kimi K2.5-shaped layer (shrunk) decoding: the Pallas MLA + int4 paths equal the XLA reference.
    assert [r["batch"] for r in result["kimi_layer"]] == [1, 8] and all(r["agree"] for r in result["kimi_layer"])
    engine = result["engine"]
    # Started with --kv-cache-gb auto: the plan's pool from the stated 1.02 GiB.
    assert engine["auto_pool"]["pages"] > 0 and "KV pages" in engine["auto_pool"]["plan"]
    assert engine["kernel"]["agree"] and engine["programs"] > 0
    assert [(d["batch"], d["run_ahead"]) for d in engine["decode"]] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(d["output_tokens_per_s"] > 0 and 0 < d["host_share"] < 1 for d in engine["decode"])
    assert [p["prompt_tokens"] for p in engine["prefill"]] == [24, 48] and engine["batch1_roofline_fraction"] > 0
    out = capsys.readouterr().out
    assert "bit-exact (whole tensors, single layers, every tile) and MoE paths agree: yes" in out
    assert "paged_attention against its reference" in out and "of its roofline" in out


def test_bench_compression_runs(tmp_path, monkeypatch):
    weights = tmp_path / "w.safetensors"
    save_file({"w": (np.random.default_rng(0).standard_normal((128, 1024)) * 0.02).astype(np.float32)}, weights)
    out = tmp_path / "bench.json"
    assert load_script("bench_compression", monkeypatch).main(["--weights", str(weights), "--repeats", "1",
                                                  "--output", str(out)]) == 0
    total = json.loads(out.read_text())["total"]
    assert total["exact"] and total["tensors"] == 1 and total["reference_gbps"] > 0
