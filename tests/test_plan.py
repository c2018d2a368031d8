"""`jfire plan`: memory per device from a config alone, checked against hand arithmetic.

The plans that need several devices run the CLI in a child process: the fake CPU device
count must be set before JAX starts there (this process has one CPU device).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jfire import mesh as meshes
from jfire import plan
from jfire.errors import JfireError

REPO = Path(__file__).resolve().parents[1]
SCOUT = REPO / "tests" / "data" / "llama4-scout-17b-16e-instruct"
GIB = 1 << 30

# A tiny Mixtral: 4 layers, 4 heads / 2 KV heads of 16, 4 experts top-2.
TINY = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1e6,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def run_plan(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from jfire.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "plan", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def plan_json(*args: str) -> dict:
    proc = run_plan(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def scout():
    return plan_json("--model", str(SCOUT), "--mesh", "h200x2-llama4-scout")


def scout_hand_count() -> tuple[int, int]:
    """(parameters, bf16 bytes per device on tp=2) of Llama 4 Scout's text model, from the
    config.json numbers alone: what tp=2 splits (vocabulary, heads, expert and shared widths)
    halves; the norms and the router stay whole on both devices."""
    text = json.loads((SCOUT / "config.json").read_text())["text_config"]
    V, E, L = text["vocab_size"], text["hidden_size"], text["num_hidden_layers"]
    H, K, D = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    X, F = text["num_local_experts"], text["intermediate_size"]
    assert text["interleave_moe_layer_step"] == 1  # every layer is MoE in Scout
    embeddings, lm_head = V * E, E * V
    attention = E * H * D + 2 * E * K * D + H * D * E  # q, k, v, o
    norms = 2 * E  # input_layernorm, post_attention_layernorm
    router = E * X
    experts = X * E * 2 * F + X * F * E  # gate_up_proj [X, E, 2F], down_proj [X, F, E]
    shared = 3 * E * F  # shared_expert gate, up, down
    final_norm = E
    split = embeddings + lm_head + L * (attention + experts + shared)
    whole = L * (norms + router) + final_norm
    return split + whole, 2 * (split // 2 + whole)


def test_scout_weights_match_the_hand_count(scout):
    params, per_device = scout_hand_count()
    assert scout["parameters"] == params
    assert round(params / 1e9, 1) == 107.8  # SEED-MODELS.md: 107.8 B text parameters
    assert scout["dtype"] == "bfloat16" and scout["parameter_bytes"] == 2 * params
    assert scout["weight_bytes_per_device"] == per_device
    assert [d["weight_bytes"] for d in scout["per_device"]] == [per_device, per_device]
    assert scout["kv_head_replication"] == 1


def test_scout_kv_bytes_per_token(scout):
    assert scout["kv_bytes_per_token"] == 48 * 8 * 128 * 2 * 2  # 192 KiB, over both devices
    assert [d["kv_bytes_per_token"] for d in scout["per_device"]] == [48 * 4 * 128 * 2 * 2] * 2


def test_scout_has_more_kv_room_than_infire_on_two_h200s(scout):
    assert scout["devices"] == 2 and scout["device_kind"] == "H200" and scout["device_memory_gib"] == 140.0
    assert scout["workspace_source"] == "measured" and scout["workspace_bytes_per_device"] > GIB
    assert scout["reserve_bytes_per_device"] == GIB
    # Infire: "over 56 GiB free for KV cache"; all costs counted, jfire leaves at least 60.
    assert scout["kv_bytes_free_total"] >= 60 * GIB
    assert scout["fits"] and scout["kv_capacity_tokens"] == scout["kv_bytes_free_total"] // scout["kv_bytes_per_token"]
    text = plan.format_plan(scout)
    for fragment in ("107,769,861,120 (107.8 B)", "2 x H200", "XLA:CPU", "measured", "a stated constant",
                     "--kv-cache-gb"):
        assert fragment in text


def check_consistent(p: dict) -> None:
    for key in ("devices", "weight_bytes_per_device", "kv_bytes_per_token", "kv_bytes_free_total",
                "kv_capacity_tokens", "fits", "per_device", "mesh", "device_kind", "device_memory_gib",
                "workspace_source"):
        assert key in p
    assert len(p["per_device"]) == p["devices"]
    for d in p["per_device"]:
        assert d["kv_bytes_free"] == d["memory_bytes"] - d["weight_bytes"] - d["workspace_bytes"] - d["reserve_bytes"]
        assert d["memory_bytes"] == round(p["device_memory_gib"] * GIB)
    assert p["weight_bytes_per_device"] == max(d["weight_bytes"] for d in p["per_device"])
    assert p["kv_bytes_free_total"] == sum(d["kv_bytes_free"] for d in p["per_device"])
    assert p["kv_bytes_per_token"] == sum(d["kv_bytes_per_token"] for d in p["per_device"])
    assert p["kv_capacity_tokens"] == p["kv_bytes_free_total"] // p["kv_bytes_per_token"]
    source = "workspace_bytes" if p["workspace_source"] == "measured" else "estimate_bytes"
    assert p["workspace_bytes_per_device"] == max(w[source] for w in p["workspace_programs"])


def test_tiny_moe_plan_measures_its_programs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    mesh_file = tmp_path / "tiny-pp2-tp4.toml"
    mesh_file.write_text('[mesh]\npp = 2\ntp = 4\n\n[device]\nkind = "TestChip"\nmemory_gib = 2.0\n')
    p = plan_json("--model", str(tmp_path), "--mesh", str(mesh_file), "--max-batch", "8", "--prefill-budget", "64")
    check_consistent(p)
    assert p["devices"] == 8 and p["device_kind"] == "TestChip" and p["device_memory_source"] == "mesh file"
    assert p["workspace_source"] == "measured"
    assert all(w["temp_bytes"] > 0 and w["workspace_bytes"] > 0 for w in p["workspace_programs"])
    assert [(w["program"], w["rows"], w["tokens_per_row"]) for w in p["workspace_programs"]] == [
        ("decode", 8, 1), ("prefill", 4, 16)]
    # tp=4 over 2 KV heads repeats each twice: the cache costs double, and it is counted.
    assert p["kv_head_replication"] == 2
    assert p["kv_bytes_per_token"] == 4 * (2 * 2) * 16 * 2 * 2
    assert p["fits"]


def test_single_device_estimate_in_process(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    p = plan.plan(tmp_path, meshes.resolve("single"), compile=False, device_memory_gib=1.5,
                  limits=plan.Limits(max_batch=4, prefill_budget=32, max_context=64))
    check_consistent(p)
    assert p["workspace_source"] == "estimate" and p["device_memory_source"] == "--device-memory-gib"
    assert p["weight_bytes_per_device"] == p["parameter_bytes"]  # one device holds everything
    assert p["kv_bytes_per_token"] == 4 * 2 * 16 * 2 * 2
    assert p["max_context"] == 64 and p["workspace_programs"][0]["pages_per_row"] == 4


def test_a_mesh_the_model_cannot_take_is_refused():
    proc = run_plan("--model", str(SCOUT), "--mesh", "tp=3", "--device-memory-gib", "80")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "does not fit" in proc.stderr and "tp=3 does not divide the 40 attention heads" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_config_json_is_refused(tmp_path):
    with pytest.raises(JfireError, match="has no config.json"):
        plan.read_model_config(tmp_path)
    with pytest.raises(JfireError, match="does not exist"):
        plan.read_model_config(tmp_path / "nowhere")


def test_device_memory_comes_from_the_mesh_file_or_the_flag(tmp_path):
    with pytest.raises(JfireError, match=r"add a \[device\] table.*--device-memory-gib"):
        plan.device_memory(meshes.resolve("tp=2"), None)
    assert plan.device_memory(meshes.resolve("tp=2"), 80.0) == (None, 80.0, "--device-memory-gib")
    assert plan.device_memory(meshes.resolve("h100x8-kimi-k2"), None) == ("H100", 79.6, "mesh file")
    bad = tmp_path / "bad.toml"
    bad.write_text("[mesh]\ntp = 2\n\n[device]\nmemory_gib = -1\n")
    with pytest.raises(JfireError, match="memory_gib must be a positive number"):
        meshes.MeshSpec.from_toml(bad)
    bad.write_text("[mesh]\ntp = 2\n\n[device]\nmemory = 80\n")
    with pytest.raises(JfireError, match=r"\[device\] takes kind"):
        meshes.MeshSpec.from_toml(bad)
