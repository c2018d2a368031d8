"""`jfire plan`: memory per device from a config alone, checked against hand arithmetic.

The plans that need several devices run the CLI in a child process: the fake CPU device
count must be set before JAX starts there (this process has one CPU device).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jfire import mesh as meshes
from jfire import plan, plan_vision
from jfire.errors import JfireError

REPO = Path(__file__).resolve().parents[1]
SCOUT = REPO / "tests" / "data" / "llama4-scout-17b-16e-instruct"
KIMI = REPO / "tests" / "data" / "kimi-k2.5"
DEEPSEEK_V3 = REPO / "tests" / "data" / "deepseek-v3"
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
    assert round(params / 1e9, 1) == 107.8  # the text model of Meta's "109B total parameters" (with vision)
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
    check_consistent(scout)
    # A pool per kind of layer holds at least what one pool for every layer would.
    assert scout["fits"] and scout["kv_capacity_tokens"] >= scout["kv_pages_one_pool"] * scout["page_size"]
    text = plan.format_plan(scout)
    for fragment in ("107,769,861,120 (107.8 B)", "2 x H200", "XLA:CPU", "measured", "a stated constant",
                     "--kv-cache-gb", "global: ", "chunked: "):
        assert fragment in text


def scout_pools_hand_count(budget: int, *, rows: int, step: int) -> dict[str, int]:
    """Llama 4 Scout's pages per cache group on tp=2 for `budget` bytes of KV a device, from the
    released config's numbers: the NoPE layers (no_rope_layers 0) attend every earlier position,
    the others their own chunk of attention_chunk_size. Each row of the chunked layers' pool
    holds at once the positions from the start of its step's first query's chunk (at most
    chunk - 1 before that query) to the step's last: chunk - 1 + step positions, which span at
    most ceil((chunk - 2 + step) / page) + 1 pages wherever they start; every one of the `rows`
    rows has that reserved, and the global layers' pool gets the rest."""
    text = json.loads((SCOUT / "config.json").read_text())["text_config"]
    K, D, chunk = text["num_key_value_heads"], text["head_dim"], text["attention_chunk_size"]
    rope = text["no_rope_layers"]  # transformers' flag: 1 = RoPE (chunked attention), 0 = NoPE (global)
    assert len(rope) == text["num_hidden_layers"] == 48 and rope.count(0) == 12 and chunk == 8192
    tp, page = 2, 16  # the mesh's tp, the engine's page size
    token_layer = K // tp * D * 2 * 2  # a token in one layer on a device: its 4 KV heads' K and V in bf16
    global_page, chunked_page = rope.count(0) * token_layer * page, rope.count(1) * token_layer * page
    chunked_pages = rows * (-(-(chunk - 2 + step) // page) + 1)
    return {"global": (budget - chunked_pages * chunked_page) // global_page, "chunked": chunked_pages,
            "global_page": global_page, "chunked_page": chunked_page}


MILLION = ("--max-context", "1048576", "--max-batch", "8")
ONE_POOL_TOKENS = 376_864  # Scout's plan on h200x2 with one pool for all 48 layers, before pools per kind


@pytest.fixture(scope="module")
def scout_million():
    return plan_json("--model", str(SCOUT), "--mesh", "h200x2-llama4-scout", *MILLION)


def test_scout_holds_a_million_token_context_in_a_pool_per_kind_of_layer(scout_million):
    """Scout on two H200s with room for a 1,048,576-token conversation (issue 43): its 36 chunked
    layers keep only their rows' current chunks, so the 12 global layers' pool holds over three
    times the 376,864 tokens that one pool for all 48 layers held (the README's plan at the
    default limits, before pools per kind)."""
    p = scout_million
    check_consistent(p)
    budget = p["kv_budget_bytes_per_device"]
    assert budget == min(d["kv_bytes_free"] for d in p["per_device"])
    hand = scout_pools_hand_count(budget, rows=8, step=256)  # --max-batch 8; the default --prefill-budget
    assert (hand["chunked"], hand["chunked_page"], hand["global_page"]) == (8 * 529, 1_179_648, 393_216)
    assert {name: g["pages"] for name, g in p["kv_groups"].items()} == {"global": hand["global"],
                                                                         "chunked": hand["chunked"]}
    assert [g["page_bytes_per_device"] for g in p["kv_groups"].values()] == [hand["global_page"], hand["chunked_page"]]
    assert p["kv_capacity_tokens"] == 16 * hand["global"] >= 3 * ONE_POOL_TOKENS
    assert p["fits"] and p["max_tokens_per_sequence"] == 1_048_576 and not p["kv_pools_shared"]
    assert p["kv_pages"] == hand["global"]  # what EngineConfig.num_pages means: a full-attention group's pages
    # An engine keeping one pool for every group (one moving pages by id) gets from the same bytes
    # what one pool for all layers always held.
    assert p["kv_pages_one_pool"] == p["kv_cache_bytes_per_device"] // (hand["global_page"] + hand["chunked_page"])
    text = plan.format_plan(p)
    for fragment in (f"-> {16 * hand['global']:,} tokens (1.2 sequences of 1,048,576), a pool per kind of layer",
                     f"global: {hand['global']:,} pages", "chunked: 4,232 pages", "8 rows x 529 pages",
                     f"({hand['global']:,} global, 4,232 chunked pages of 16)"):
        assert fragment in text, fragment


# Kimi K2.5's released `vision_config` (moonshotai/Kimi-K2.5's config.json, remote-code `vt_*` names).
# tests/data/kimi-k2.5/config.json holds a shortened one that jfire's vision config cannot read
# (no head count), which the engine would refuse as well; the plans use the released one.
RELEASED_KIMI_VISION_CONFIG = {
    "init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64, "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool", "mm_hidden_size": 1152, "mm_projector_type": "patchmerger", "model_type": "",
    "patch_size": 14, "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
    "text_hidden_size": 7168, "video_attn_type": "spatial_temporal", "vt_hidden_size": 1152,
    "vt_intermediate_size": 4304, "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27,
}


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    """tests/data/kimi-k2.5 with the released vision config."""
    config = json.loads((KIMI / "config.json").read_text())
    config["vision_config"] = RELEASED_KIMI_VISION_CONFIG
    path = tmp_path_factory.mktemp("kimi-k2.5")
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    return plan_json("--model", str(kimi_dir), "--mesh", "h100x8-kimi-k2")


def kimi_hand_count(pp: int = 2, tp: int = 4) -> tuple[int, int]:
    """(parameters, bytes per device on pp x tp) of Kimi K2.5's text model from the config.json
    numbers alone: DeepSeek-V3's architecture (`mla_hand_count`) with the routed experts int4,
    4 bits a weight plus one bf16 scale per 32 inputs."""
    config = json.loads((KIMI / "config.json").read_text())
    quant = config["quantization_config"]["config_groups"]["group_0"]
    assert quant["weights"]["num_bits"] == 4 and quant["weights"]["group_size"] == 32
    return mla_hand_count(config["text_config"], lambda routed: routed // 2 + routed // 32 * 2, pp, tp)


def deepseek_v3_hand_count(pp: int = 2, tp: int = 8) -> tuple[int, int]:
    """The same for DeepSeek-V3 as released: the routed experts FP8, a byte a weight, plus one
    float32 scale per 128 x 128 block of each expert's [out, in] matrices."""
    text = json.loads((DEEPSEEK_V3 / "config.json").read_text())
    assert text["quantization_config"]["weight_block_size"] == [128, 128]
    E, F, X = text["hidden_size"], text["moe_intermediate_size"], text["n_routed_experts"]
    blocks = -(-F // 128) * -(-E // 128)  # per matrix: gate and up [F, E], down [E, F]
    return mla_hand_count(text, lambda routed: routed + 3 * X * blocks * 4, pp, tp)


def mla_hand_count(text: dict, routed_bytes, pp: int, tp: int) -> tuple[int, int]:
    """(parameters, bytes per device on pp x tp) of a DeepSeek-V3-architecture text config.
    Everything is bf16 (2 bytes) but the routed experts (`routed_bytes(weights)`: one layer's
    bytes, scales included; scales are bytes, not parameters) and the router's
    score-correction bias, float32.

    How the mesh splits it: the embedding and LM head split their vocabulary over all pp x tp
    devices; the MoE layers split over the pp stages; within a layer tp splits the heads
    (q_b, kv_b, o), the MLP widths (dense, shared and routed experts, their scales too), the
    low-rank query (q_a and its norm, over the rank) and the inputs of kv_a and the router;
    the router's bias and the other norms stay whole on every device; the dense first layers
    run on every stage, so each device holds its share."""
    V, E, L, H = text["vocab_size"], text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]
    Q, C, R = text["q_lora_rank"], text["kv_lora_rank"], text["qk_rope_head_dim"]
    Dn, Dv = text["qk_nope_head_dim"], text["v_head_dim"]
    F_dense, F, X = text["intermediate_size"], text["moe_intermediate_size"], text["n_routed_experts"]
    shared_width = F * text["n_shared_experts"]
    dense = text["first_k_dense_replace"]
    moe = L - dense
    # Attention: q_a [E, Q], its norm, q_b [Q, H, Dn + R]; kv_a [E, C + R], its norm, kv_b [C, H, Dn + Dv];
    # o [H, Dv, E]; the input and post-attention norms.
    whole = E + C + E  # per layer, on every device of its stage: the input, kv_a and post-attention norms
    low_rank = E * Q + Q + E * (C + R)  # per layer, split over tp
    heads = Q * H * (Dn + R) + C * H * (Dn + Dv) + H * Dv * E  # per layer, split over tp
    dense_mlp = 3 * E * F_dense  # gate, up, down
    router = E * X
    shared = 3 * E * shared_width
    routed = 3 * X * E * F  # gate, up [X, F, E] and down [X, E, F]
    embeddings = lm_head = V * E
    params = (embeddings + lm_head + E + L * (whole + low_rank + heads) + dense * dense_mlp
              + moe * (router + X + shared + routed))
    assert moe % pp == 0
    per_device = (2 * (embeddings + lm_head) // (pp * tp) + 2 * E  # + final norm
                  + dense * (2 * whole + 2 * (low_rank + heads + dense_mlp) // tp)
                  + moe // pp * (2 * whole + 4 * X + 2 * (low_rank + router + heads + shared) // tp
                                 + routed_bytes(routed) // tp))
    return params, per_device


def test_kimi_weights_match_the_hand_count(kimi):
    params, per_device = kimi_hand_count()
    assert kimi["parameters"] == params
    assert round(params / 1e9) == 1026  # Moonshot's model card: "1T total parameters"
    routed = 60 * 3 * 384 * 7168 * 2048
    assert kimi["int4_parameters"] == routed
    assert kimi["int4_bytes"] == routed // 2 and kimi["scale_bytes"] == routed // 32 * 2
    assert round((kimi["int4_bytes"] + kimi["scale_bytes"]) / GIB, 1) == 531.6  # 4.5 bits a routed weight
    assert round(kimi["parameter_bytes"] / GIB, 1) == 553.4  # with the bf16 rest: 21.8 GiB
    assert kimi["weight_bytes_per_device"] == per_device and round(per_device / GIB, 2) == 69.29
    assert [d["weight_bytes"] for d in kimi["per_device"]] == [per_device] * 8
    assert kimi["family"] == "deepseek_v3" and kimi["mesh"]["pp"] == 2 and kimi["mesh"]["tp"] == 4
    assert "not parameters" in kimi["parameters_note"]


def test_kimi_kv_bytes_per_token(kimi):
    # The model's cache: one 512 + 64 latent per token per layer, in bf16, each layer once.
    assert kimi["kv_bytes_per_token_model"] == 61 * 576 * 2  # 68.6 KiB
    # On the mesh: a stage's 30 MoE layers and the dense layer (kept on both stages), with
    # the pages split over the stage's 4 devices.
    per_device = (30 + 1) * 576 * 2 // 4
    assert [d["kv_bytes_per_token"] for d in kimi["per_device"]] == [per_device] * 8
    assert kimi["kv_bytes_per_token"] == 8 * per_device == (60 + 2 * 1) * 576 * 2


def test_kimi_kv_room_on_eight_h100s(kimi):
    check_consistent(kimi)
    _, weights = kimi_hand_count()
    assert kimi["device_kind"] == "H100" and kimi["device_memory_gib"] == 79.6
    assert kimi["workspace_source"] == "measured" and "tiled" in kimi["workspace_note"]
    workspace = kimi["workspace_bytes_per_device"]
    # Most of it is one MoE layer's local experts sliced out of the stack per scan step: packed
    # int32 words and float32 scales (the CPU measurement's dtype); far from the 15.75 GiB of
    # float32 weights that unpacking a layer's experts (the CPU's "xla" path) would hold.
    layer_experts = 3 * 384 * 7168 * 2048 // 4 // 2 + 3 * 384 * 7168 * 2048 // 4 // 32 * 4
    assert layer_experts <= workspace <= layer_experts + GIB
    free = round(79.6 * GIB) - weights - workspace - GIB
    # Device 0 also holds the vision tower (its encoder's workspace is below the programs').
    tower = kimi["vision_param_bytes"]
    assert kimi["kv_bytes_free_total"] == 8 * free - tower
    # Pages of 16 tokens, each device holding a quarter of a page (its stage's 31 layers x 576
    # values in bf16, the pages split 4 ways), in whole multiples of the split.
    page = 16 * (30 + 1) * 576 * 2 // 4
    assert kimi["kv_pages"] == (free - tower) // page // 4 * 4 and kimi["kv_capacity_tokens"] == 16 * kimi["kv_pages"]
    # Infire publishes "over 30 GiB" of KV cache on 8 H100s; jfire leaves over 50 GiB even with
    # its upper-bound workspace (float32 scales, one layer's experts copied per step).
    assert kimi["kv_bytes_free_total"] >= 50 * GIB
    assert kimi["fits"] and kimi["kv_pages"] % 4 == 0  # whole multiples of the 4-way page split
    text = plan.format_plan(kimi)
    for fragment in ("1,026,408,232,448 (1026.4 B)", "int4 weights", "not parameters", "8 x H100",
                     "the model's cache: 68.6 KiB"):
        assert fragment in text


@pytest.fixture(scope="module")
def deepseek_v3():
    return plan_json("--model", str(DEEPSEEK_V3), "--mesh", "h100x16-deepseek-v3-fp8")


def test_deepseek_v3_fp8_weights_match_the_hand_count(deepseek_v3):
    params, per_device = deepseek_v3_hand_count()
    assert deepseek_v3["parameters"] == params
    assert round(params / 1e9) == 671  # DeepSeek-V3: 671 B parameters (the MTP layer is not loaded)
    routed = 58 * 3 * 256 * 7168 * 2048
    assert deepseek_v3["fp8_parameters"] == deepseek_v3["fp8_bytes"] == routed  # a byte a weight
    assert deepseek_v3["scale_bytes"] == 58 * 3 * 256 * 16 * 56 * 4
    assert deepseek_v3["weight_bytes_per_device"] == per_device and round(per_device / GIB, 2) == 40.27
    assert [d["weight_bytes"] for d in deepseek_v3["per_device"]] == [per_device] * 16


def test_deepseek_v3_fp8_on_two_hosts_of_eight_h100s(deepseek_v3):
    """The mesh spans 2 hosts (one pipeline stage each); the FP8 experts leave room for the cache."""
    check_consistent(deepseek_v3)
    assert deepseek_v3["devices"] == 16 and deepseek_v3["mesh"]["pp"] == 2 and deepseek_v3["mesh"]["tp"] == 8
    assert meshes.resolve("h100x16-deepseek-v3-fp8").hosts == 2
    _, weights = deepseek_v3_hand_count()
    workspace = deepseek_v3["workspace_bytes_per_device"]
    # Mostly one MoE layer's local experts dequantized in its step (float32, the measurement's
    # dtype): at least that, and far from every layer's (XLA:CPU's whole-stack FP8 widening).
    layer_experts = 3 * 256 * 7168 * 2048 // 8 * 4
    assert layer_experts <= workspace <= layer_experts + 3 * GIB
    free = round(79.6 * GIB) - weights - workspace - GIB
    assert deepseek_v3["kv_bytes_free_total"] == 16 * free
    # A stage's 29 MoE layers and the 3 dense layers (kept on both stages), pages split over its 8 devices.
    assert [d["kv_bytes_per_token"] for d in deepseek_v3["per_device"]] == [(29 + 3) * 576 * 2 // 8] * 16
    assert deepseek_v3["kv_bytes_free_total"] >= 400 * GIB and deepseek_v3["fits"]
    text = plan.format_plan(deepseek_v3)
    for fragment in ("671,026,419,200 (671.0 B)", "FP8 weights", "not parameters", "16 x H100"):
        assert fragment in text


def check_consistent(p: dict) -> None:
    for key in ("devices", "weight_bytes_per_device", "kv_bytes_per_token", "kv_bytes_free_total",
                "kv_capacity_tokens", "fits", "per_device", "mesh", "device_kind", "device_memory_gib",
                "workspace_source"):
        assert key in p
    assert len(p["per_device"]) == p["devices"]
    for d in p["per_device"]:
        assert d["kv_bytes_free"] == (d["memory_bytes"] - d["weight_bytes"] - d["vision_param_bytes"]
                                      - d["workspace_bytes"] - d["reserve_bytes"])
        assert d["memory_bytes"] == round(p["device_memory_gib"] * GIB)
        # The encoder runs between the programs: its device counts the larger workspace.
        assert d["workspace_bytes"] == max(p["workspace_bytes_per_device"], d["encoder_workspace_bytes"])
    vision = p["vision"]
    held = [d["index"] for d in p["per_device"] if d["vision_param_bytes"]]
    if vision is None:
        assert p["vision_parameters"] == p["vision_param_bytes"] == p["encoder_workspace_bytes"] == 0 and not held
        assert all(d["encoder_workspace_bytes"] == 0 for d in p["per_device"])
    else:
        assert held == vision["devices"] and vision["encoder_device"] == held[0]
        assert all(d["vision_param_bytes"] == p["vision_param_bytes"] == vision["param_bytes"]
                   for d in p["per_device"] if d["index"] in held)
        encoder = [d["encoder_workspace_bytes"] for d in p["per_device"]]
        assert encoder[held[0]] == p["encoder_workspace_bytes"] > 0 and sum(encoder) == encoder[held[0]]
    assert p["weight_bytes_per_device"] == max(d["weight_bytes"] for d in p["per_device"])
    assert p["kv_bytes_free_total"] == sum(d["kv_bytes_free"] for d in p["per_device"])
    assert p["kv_bytes_per_token"] == sum(d["kv_bytes_per_token"] for d in p["per_device"])
    # The pools: whole pages within the room of the device with the least.
    budget = max(0, min(d["kv_bytes_free"] for d in p["per_device"]))
    assert p["kv_budget_bytes_per_device"] == budget
    groups = p["kv_groups"].values()
    assert p["kv_cache_bytes_per_device"] == sum(g["bytes_per_device"] for g in groups) <= budget
    assert all(g["bytes_per_device"] == g["pages"] * g["page_bytes_per_device"] for g in groups)
    assert sum(g["kv_bytes_per_token"] for g in groups) == p["kv_bytes_per_token"]
    assert p["kv_capacity_tokens"] == p["kv_pages"] * p["page_size"]
    assert p["max_tokens_per_sequence"] == min(p["max_context"], p["kv_capacity_tokens"]) or all(
        g["window"] for g in groups)
    if len(groups) == 1:  # one pool: as many whole pages as the room holds (the multiples of a split pages axis)
        (g,) = groups
        assert g["pages"] == p["kv_pages"] and budget - p["kv_cache_bytes_per_device"] < 8 * g["page_bytes_per_device"]
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
    # A text-only model: no vision tower, nothing of it anywhere.
    assert p["vision"] is None and p["vision_parameters"] == 0 and "vision" not in plan.format_plan(p)
    assert all(d["workspace_bytes"] == p["workspace_bytes_per_device"] for d in p["per_device"])


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


def test_the_int4_path_the_plan_measures_computes_the_grouped_matmul():
    """The workspace is measured with packed experts through `impl="tiled"` (the GPU kernel's
    tiling in lax loops): it is the same grouped matmul as the CPU's "xla" path, and
    `use_impl` is what routes the models' expert matmul to it."""
    import jax.numpy as jnp
    import numpy as np

    from jfire.kernels import int4_experts
    from jfire.models import moe

    rng = np.random.default_rng(0)
    packed, scale = int4_experts.pack_int4(rng.normal(size=(4, 128, 64)).astype(np.float32))
    xs = jnp.asarray(rng.normal(size=(37, 64)), jnp.float32)
    sizes = jnp.asarray([20, 0, 9, 3], jnp.int32)  # an empty expert; rows past the 32 assigned stay zero
    want = np.asarray(int4_experts.ragged_dot_int4(xs, packed, scale, sizes, impl="xla"))
    with int4_experts.use_impl(plan.INT4_IMPL):
        assert int4_experts.default_impl() == "tiled"
        got = np.asarray(moe._ragged_dot(xs, {"packed": packed, "scale": scale}, sizes))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not got[32:].any()
    assert int4_experts.default_impl() == "xla"
    with pytest.raises(ValueError, match="unknown impl"):
        int4_experts.use_impl("fast")


# -- the README's plans --------------------------------------------------------------------------
# The README is the one place a plan's figures are written down: the mesh files and
# jfire/plan.py say in words what a plan shows and point at `jfire plan`. These tests hold the
# README's figures to the plans computed above (tests/test_readme.py also runs its commands).

README = REPO / "README.md"


def readme_plans() -> dict[tuple[str, ...], list[str]]:
    """The README's `jfire plan` examples: (--model, --mesh, the other arguments...) -> the
    lines shown after it."""
    from tests.test_readme import commands

    plans = {}
    for _, command, shown in commands(README.read_text()):
        argv = shlex.split(command)
        if argv[:2] == [".venv/bin/jfire", "plan"]:
            assert shown, command
            model, mesh = argv.index("--model"), argv.index("--mesh")
            rest = tuple(a for i, a in enumerate(argv[2:], 2) if i not in (model, model + 1, mesh, mesh + 1))
            plans[(argv[model + 1], argv[mesh + 1], *rest)] = shown
    return plans


def test_the_readme_shows_the_plans_the_code_makes(scout, scout_million, kimi, deepseek_v3):
    from tests.test_readme import matches

    made = {(str(SCOUT.relative_to(REPO)), "h200x2-llama4-scout"): scout,
            (str(SCOUT.relative_to(REPO)), "h200x2-llama4-scout", *MILLION): scout_million,
            (str(KIMI.relative_to(REPO)), "h100x8-kimi-k2"): kimi,
            (str(DEEPSEEK_V3.relative_to(REPO)), "h100x16-deepseek-v3-fp8"): deepseek_v3}
    plans = readme_plans()  # and a comparison (DeepSeek-V3 on tp=16) that tests/test_readme.py runs alone
    assert made.keys() <= plans.keys()
    for key, p in made.items():
        printed = plan.format_plan({**p, "model": key[0]})
        assert matches(plans[key], printed), f"the README's plan {' '.join(key)} is not\n{printed}"


def test_the_readme_figures_beside_the_scout_plans_are_the_code_s(scout_million):
    """What the README's prose says of Scout's pools per kind, from the same plan."""
    text = " ".join(README.read_text().split())
    one_pool = re.search(r"One pool for all 48 layers held ([\d,]+) tokens \(the plan at the default limits, before "
                         r"the pools per kind\); the pools per kind hold ([\d.]+) times that", text)
    assert one_pool and one_pool[1] == f"{ONE_POOL_TOKENS:,}"
    assert one_pool[2] == f"{scout_million['kv_capacity_tokens'] / ONE_POOL_TOKENS:.1f}"
    assert f"one conversation may use all {scout_million['max_tokens_per_sequence']:,} tokens" in text


def test_the_readme_figures_beside_the_plans_are_the_code_s(deepseek_v3):
    """What the README's prose says of the DeepSeek-V3 plan, from the same config and plan."""
    text = " ".join(README.read_text().split())
    config = json.loads((DEEPSEEK_V3 / "config.json").read_text())
    bf16 = re.search(r"in bf16 the weights alone would need ([\d,]+) GiB", text)
    assert bf16 and bf16[1] == f"{2 * deepseek_v3['parameters'] / GIB:,.0f}"
    # One MoE layer's local experts (tp=8 splits their width) in float32, and in bf16.
    E, F, X = config["hidden_size"], config["moe_intermediate_size"], config["n_routed_experts"]
    layer_experts = 3 * X * E * F // deepseek_v3["mesh"]["tp"] * 4
    experts = re.search(r"one layer's local experts dequantized in float32 \(([\d.]+) GiB; ([\d.]+) in bf16", text)
    assert experts and experts[1] == f"{layer_experts / GIB:.2f}" and experts[2] == f"{layer_experts / 2 / GIB:.1f}"
    assert layer_experts <= deepseek_v3["workspace_bytes_per_device"]


# -- the vision towers ---------------------------------------------------------------------------
# Counted from jfire's declarations (jfire/vision/llama4.py, kimi_k25.py), checked here against
# counts that do not read them: transformers' own Llama 4 vision modules built on the meta
# device, and the released Kimi K2.5 checkpoint's tensor list.


def hf_llama4_vision_parameters(config: dict) -> int:
    """Llama4VisionModel + Llama4MultiModalProjector with the released config's dims, built by
    transformers on the meta device (nothing allocated): their parameter count."""
    import torch
    from transformers import Llama4Config
    from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector, Llama4VisionModel

    hf = Llama4Config(vision_config=config["vision_config"], text_config=config["text_config"])
    with torch.device("meta"):
        modules = [Llama4VisionModel(hf.vision_config), Llama4MultiModalProjector(hf)]
    return sum(p.numel() for m in modules for p in m.parameters())


# The vision tensors of moonshotai/Kimi-K2.5's safetensors (model-00063/64-of-000064): name,
# shape, how many (per encoder block: 27).
KIMI_RELEASED_VISION_TENSORS = [
    ("mm_projector.pre_norm.bias", [1152], 1), ("mm_projector.pre_norm.weight", [1152], 1),
    ("mm_projector.proj.0.bias", [4608], 1), ("mm_projector.proj.0.weight", [4608, 4608], 1),
    ("mm_projector.proj.2.bias", [7168], 1), ("mm_projector.proj.2.weight", [7168, 4608], 1),
    ("vision_tower.encoder.blocks.{i}.mlp.fc0.bias", [4304], 27),
    ("vision_tower.encoder.blocks.{i}.mlp.fc0.weight", [4304, 1152], 27),
    ("vision_tower.encoder.blocks.{i}.mlp.fc1.bias", [1152], 27),
    ("vision_tower.encoder.blocks.{i}.mlp.fc1.weight", [1152, 4304], 27),
    ("vision_tower.encoder.blocks.{i}.norm0.bias", [1152], 27),
    ("vision_tower.encoder.blocks.{i}.norm0.weight", [1152], 27),
    ("vision_tower.encoder.blocks.{i}.norm1.bias", [1152], 27),
    ("vision_tower.encoder.blocks.{i}.norm1.weight", [1152], 27),
    ("vision_tower.encoder.blocks.{i}.wo.bias", [1152], 27),
    ("vision_tower.encoder.blocks.{i}.wo.weight", [1152, 1152], 27),
    ("vision_tower.encoder.blocks.{i}.wqkv.bias", [3456], 27),
    ("vision_tower.encoder.blocks.{i}.wqkv.weight", [3456, 1152], 27),
    ("vision_tower.encoder.final_layernorm.bias", [1152], 1),
    ("vision_tower.encoder.final_layernorm.weight", [1152], 1),
    ("vision_tower.patch_embed.pos_emb.weight", [64, 64, 1152], 1),
    ("vision_tower.patch_embed.proj.bias", [1152], 1),
    ("vision_tower.patch_embed.proj.weight", [1152, 3, 14, 14], 1),
]


def test_scout_counts_its_vision_tower_on_the_first_device(scout):
    import math

    config = json.loads((SCOUT / "config.json").read_text())
    count = hf_llama4_vision_parameters(config)
    assert count == 871_932_416  # with the text model's 107.77 B: Meta's "109B total parameters"
    assert scout["vision_parameters"] == count and scout["vision_param_bytes"] == 2 * count  # bf16
    v = scout["vision"]
    assert v["family"] == "llama4" and v["devices"] == [0] and v["encoder_device"] == 0
    assert [d["vision_param_bytes"] for d in scout["per_device"]] == [2 * count, 0]
    check_consistent(scout)
    # The largest call: 16 tiles and the global one, 577 positions each; its outputs are the 144
    # rows a tile gives at the text width, in float32 (the measurement's dtype); its pixels too.
    vision = config["vision_config"]
    assert "17 tiles" in v["encoder_call"]
    assert v["output_bytes"] == 17 * 144 * config["text_config"]["hidden_size"] * 4
    assert v["input_bytes"] == 17 * 3 * vision["image_size"] ** 2 * 4
    # At least one tile's attention logits for every head (float32), and the estimate above it.
    assert 17 * vision["num_attention_heads"] * 577**2 * 4 <= v["temp_bytes"]
    assert v["workspace_bytes"] <= v["estimate_bytes"] <= 2 * v["workspace_bytes"]
    # The device holding it has that much less KV room, and the pools are bounded by it.
    d0, d1 = scout["per_device"]
    assert d1["kv_bytes_free"] - d0["kv_bytes_free"] == 2 * count
    assert scout["kv_budget_bytes_per_device"] == d0["kv_bytes_free"]
    text = plan.format_plan(scout)
    assert f"vision      {count:,} (871.9 M)" in text and "encoder     17 tiles" in text
    assert math.isclose(scout["vision_param_bytes"] / GIB, 1.62, abs_tol=0.005)


def test_kimi_counts_its_vision_tower_as_released(kimi):
    import math

    count = sum(math.prod(shape) * n for _, shape, n in KIMI_RELEASED_VISION_TENSORS)
    assert count == 471_143_920
    assert kimi["vision_parameters"] == count and kimi["vision_param_bytes"] == 2 * count
    v = kimi["vision"]
    assert v["family"] == "kimi_k25" and v["devices"] == [0]  # one host: one copy, on device 0
    assert [d["vision_param_bytes"] for d in kimi["per_device"]] == [2 * count] + [0] * 7
    check_consistent(kimi)
    # One image padded to the 32,768-patch bucket: 8,192 merged rows at the text width out.
    assert "32,768-patch bucket" in v["encoder_call"]
    assert v["output_bytes"] == 32768 // 4 * 7168 * 4
    assert 16 * 256 * 32768 * 4 <= v["temp_bytes"]  # a block of 256 queries' logits, every head
    assert v["workspace_bytes"] <= v["estimate_bytes"] <= 2 * v["workspace_bytes"]
    assert kimi["kv_budget_bytes_per_device"] == kimi["per_device"][0]["kv_bytes_free"]


def test_kimi_images_pad_to_the_bucket_the_plan_measures():
    """No image the processor makes has more than twice max_patches once padded to whole 2x2
    groups (the plan's bound), and some have more than max_patches (so that bucket is reached)."""
    from jfire.vision import kimi_k25
    from jfire.vision.kimi_k25_preprocess import PreprocessConfig, patch_grid

    cfg = PreprocessConfig()
    most = 0
    for h in [*range(14, 9000, 37), 1800, 7168, 7181, 60000]:
        for w in [*range(14, 9000, 41), 27, 28, 1800]:
            _, gh, gw = patch_grid(h, w, cfg)
            most = max(most, gh * gw)
    assert patch_grid(1800, 1800, cfg) == (1, 130, 130)
    assert cfg.max_patches < most <= 2 * cfg.max_patches
    assert kimi_k25.patch_bucket(most) == kimi_k25.patch_bucket(2 * cfg.max_patches) == 32768


def test_scout_on_one_device_estimates_its_encoder_and_a_decode_group_holds_no_tower():
    """--no-compile (serve's auto): the encoder's stated estimate; an engine that only decodes
    (a disaggregated decode group) does not hold the tower, and its plan counts none."""
    spec = meshes.resolve("single")
    p = plan.plan(SCOUT, spec, compile=False, device_memory_gib=300.0)
    check_consistent(p)
    (d,) = p["per_device"]
    assert p["vision"]["encoder_workspace_source"] == "estimate" and "workspace_bytes" not in p["vision"]
    assert d["encoder_workspace_bytes"] == p["encoder_workspace_bytes"] == p["vision"]["estimate_bytes"]
    assert d["vision_param_bytes"] == p["vision_param_bytes"] > 0
    decode = plan.plan(SCOUT, spec, compile=False, device_memory_gib=300.0, vision=False)
    check_consistent(decode)
    assert decode["vision"] is None and decode["vision_param_bytes"] == 0
    assert decode["per_device"][0]["kv_bytes_free"] - d["kv_bytes_free"] == p["vision_param_bytes"] + (
        d["workspace_bytes"] - decode["per_device"][0]["workspace_bytes"])


def test_a_group_spanning_hosts_holds_a_tower_per_process():
    spec = meshes.resolve("h100x16-deepseek-v3-fp8")
    devices = list(range(16))
    assert spec.hosts == 2 and plan_vision.holders(spec, devices) == [0, 8]
    assert plan_vision.holders(meshes.resolve("h100x8-kimi-k2"), devices[:8]) == [0]


def test_an_unreadable_vision_config_is_refused(tmp_path):
    config = json.loads((KIMI / "config.json").read_text())
    # A shortened vision config, as some copies of the release carry: no head count.
    config["vision_config"] = {"model_type": "kimi_k25_vision", "patch_size": 14, "hidden_size": 1152,
                               "num_hidden_layers": 27}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(JfireError, match="vision config lacks the key 'vt_num_attention_heads'"):
        plan.read_vision_tower(tmp_path)
