"""`jfire plan`'s throughput and cost on paper (jfire/throughput.py, docs/plan.md), checked against
hand counts from the released configs: the numbers of Llama 4 Scout and Kimi K2.5 are written out
below (as docs/plan.md and the seed notes give them, and checked against their config.json), and
so is the arithmetic, so a reader can redo it.

The seed plans run the CLI in a child process (the fake CPU devices must be set before JAX
starts), with --no-compile: the throughput does not depend on the measured workspace.
"""

from __future__ import annotations

import json
import re

import pytest

from jfire import mesh as meshes
from jfire import plan
from jfire.errors import JfireError
from tests.test_plan import KIMI, README, SCOUT, TINY, plan_json

H200_BYTES_PER_S, H100_BYTES_PER_S = 4.8e12, 3.35e12  # spec sheets: HBM3e, HBM3
BF16_FLOPS_PER_S = 989e12  # dense bf16, both
NVLINK_BYTES_PER_S = 450e9  # NVLink 4, one direction
USD_PER_DEVICE_HOUR = 2.0  # the plan's default
CONTEXT = 4096  # every decode row this many tokens deep: the plan's default --max-context


def close(got: float, want: float) -> bool:
    return abs(got / want - 1) < 0.01


@pytest.fixture(scope="module")
def scout():
    return plan_json("--model", str(SCOUT), "--mesh", "h200x2-llama4-scout", "--no-compile")


@pytest.fixture(scope="module")
def kimi():
    return plan_json("--model", str(KIMI), "--mesh", "h100x8-kimi-k2", "--no-compile")


def test_scout_batch_1_decode_and_cost_match_the_hand_count(scout):
    # Llama 4 Scout's text model: hidden 5120, 48 layers (all MoE), 40 heads / 8 KV heads of 128,
    # vocabulary 202,048 (untied), 16 experts top-1 plus a shared one, both 8192 wide; bf16.
    E, L, H, K, D, V, X, k, F = 5120, 48, 40, 8, 128, 202048, 16, 1, 8192
    text = json.loads((SCOUT / "config.json").read_text())["text_config"]
    assert (E, L, H, K, D, V, X, k, F) == tuple(
        text[key]
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "vocab_size", "num_local_experts", "num_experts_per_tok", "intermediate_size")
    )
    tp = 2  # meshes/h200x2-llama4-scout.toml: one stage, both H200s read at once
    # One layer's weights: what tp splits (heads, expert and shared widths), what stays whole.
    attention = E * H * D + 2 * E * K * D + H * D * E  # q, k, v, o: 62,914,560
    mlp = 3 * E * F  # gate, up, down: the shared expert's, and each routed expert's: 125,829,120
    router, norms = E * X, 2 * E
    # Batch 1 touches k of the 16 experts in a layer: E (1 - (1 - k/E)^1) = k.
    layer = 2 * ((attention + mlp + k * mlp) // tp + router + norms)  # bf16 bytes on one device
    lm_head = 2 * E * V // tp  # the embedding table is looked up (a row), not read
    kv = CONTEXT * L * (K // tp) * D * 2 * 2  # the device's 4 KV heads, K and V, bf16, every layer
    read = L * layer + lm_head + 2 * E + kv  # + the final norm
    assert read == 16_545_490_944
    # Two all-reduces of the hidden state a layer (float32), a ring over 2 sends 2 (2 - 1) / 2 of them.
    link = L * 2 * E * 4 * 2 * (tp - 1) / tp
    flops = 2 * (L * (attention + 2 * mlp) // tp + E * V // tp)  # far under the bytes' time
    assert flops / BF16_FLOPS_PER_S < read / H200_BYTES_PER_S / 100
    step = read / H200_BYTES_PER_S + link / NVLINK_BYTES_PER_S  # 3.45 ms
    t = scout["throughput"]
    assert close(t["decode_tokens_per_s"]["1"], 1 / step)  # about 290 tokens/s
    cost = USD_PER_DEVICE_HOUR * 2 / (3600 / step) * 1e6  # 2 devices an hour, over the tokens of an hour
    assert close(t["usd_per_million_output_tokens"]["1"], cost)  # about $3.83
    assert t["hbm_bytes_per_s"] == tp * H200_BYTES_PER_S


def test_kimi_batch_1_decode_and_cost_match_the_hand_count(kimi):
    # Kimi K2.5's text model: hidden 7168, 61 layers (the first dense, 18432 wide), 64 heads,
    # vocabulary 163,840; MLA with q rank 1536, latent 512, rope 64, nope and v heads 128; 384
    # routed experts top-8 and one shared, 2048 wide; the routed experts int4 (4 bits a weight)
    # with a bf16 scale per 32 inputs, the rest bf16, the router's bias float32.
    E, L, H, V = 7168, 61, 64, 163840
    Q, C, R, Dn, Dv = 1536, 512, 64, 128, 128
    F_dense, F, X, k = 18432, 2048, 384, 8
    text = json.loads((KIMI / "config.json").read_text())["text_config"]
    assert (E, L, H, V, Q, C, R, Dn, Dv, F_dense, F, X, k) == tuple(
        text[key]
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "q_lora_rank",
                    "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
                    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
    )
    assert text["first_k_dense_replace"] == 1 and text["n_shared_experts"] == 1
    pp, tp = 2, 4  # meshes/h100x8-kimi-k2.toml: 2 stages of 30 MoE layers, 4 H100s each
    # Batch 1 is one micro-batch: it crosses stage 0, then stage 1 (2 ticks); the dense layer and
    # the LM head run outside the pipeline, once, on every device.
    # q_a and its norm, q_b, kv_a, kv_b, o: what tp splits
    attention = E * Q + Q + Q * H * (Dn + R) + E * (C + R) + C * H * (Dn + Dv) + H * Dv * E
    whole = 2 * (E + C + E)  # the input, kv_a and post-attention norms, on every device
    expert = 3 * E * F // 2 + 3 * E * F // 32 * 2  # one routed expert: int4 + scales, 24,772,608 bytes
    # Batch 1 touches k = 8 of the 384 experts in a layer: E (1 - (1 - k/E)^1) = k.
    moe_layer = 2 * (attention + E * X + 3 * E * F) // tp + whole + 4 * X + k * expert // tp  # + router, shared
    kv_layer = CONTEXT * (C + R) * 2 // tp  # the latent, bf16, its pages split over the stage's 4 devices
    # Over the link, a token and a layer: two all-reduces of the hidden state (float32), the query
    # gathered (bf16) and the attention's partials merged (float32 acc, max and sum): ring over 4.
    link_layer = 2 * E * 4 * 2 * 3 / 4 + H * (C + R) * 2 * 3 / 4 + H * (C + 2) * 4 * 2 * 3 / 4
    tick = (30 * (moe_layer + kv_layer)) / H100_BYTES_PER_S + 30 * link_layer / NVLINK_BYTES_PER_S
    dense_layer = 2 * (attention + 3 * E * F_dense) // tp + whole
    lm_head = 2 * E * V // (pp * tp)  # split over all 8 devices; the embedding is looked up
    once = (dense_layer + kv_layer + lm_head + 2 * E) / H100_BYTES_PER_S + link_layer / NVLINK_BYTES_PER_S
    step = once + 2 * tick  # 2.44 ms
    t = kimi["throughput"]
    assert t["assumptions"]["pipeline_ticks"]["1"] == 2
    assert close(t["decode_tokens_per_s"]["1"], 1 / step)  # about 410 tokens/s
    assert close(t["usd_per_million_output_tokens"]["1"], USD_PER_DEVICE_HOUR * 8 * step / 3600 * 1e6)  # about $10.85
    assert t["hbm_bytes_per_s"] == tp * H100_BYTES_PER_S


def test_the_throughput_object(scout, kimi):
    for p, device, bytes_per_s, experts, per_token, rows in (
        (scout, "H200", H200_BYTES_PER_S, 16, 1, {1: 1, 8: 8, 64: 64}),
        # 4 micro-batches: a layer sees a quarter of the rows at a time
        (kimi, "H100", H100_BYTES_PER_S, 384, 8, {1: 1, 8: 2, 64: 16}),
    ):
        t = p["throughput"]
        a = t["assumptions"]
        assert (a["device"], a["memory_bytes_per_s"], a["bf16_flops_per_s"], a["link_bytes_per_s"]) == (
            device, bytes_per_s, BF16_FLOPS_PER_S, NVLINK_BYTES_PER_S)
        assert a["usd_per_device_hour"] == USD_PER_DEVICE_HOUR and a["usd_per_device_hour_source"] == "default"
        assert a["efficiency"] == {"memory": 1.0, "link": 1.0, "decode_flops": 1.0, "prefill_flops": 0.5,
                                   "decode_attention_flops": 1.0, "prefill_attention_flops": 0.5, "attention_memory": 1.0}
        assert a["kv_context_tokens"] == CONTEXT and a["prefill_chunk_tokens"] == 256
        assert list(t["decode_tokens_per_s"]) == list(t["usd_per_million_output_tokens"]) == ["1", "8", "64"]
        decode = list(t["decode_tokens_per_s"].values())
        assert decode == sorted(decode)  # bigger batches share the weights they read
        for b, tps in t["decode_tokens_per_s"].items():
            assert t["usd_per_million_output_tokens"][b] == pytest.approx(
                USD_PER_DEVICE_HOUR * p["devices"] / (tps * 3600) * 1e6)
        touched = {str(b): experts * (1 - (1 - per_token / experts) ** r) for b, r in rows.items()}
        assert a["experts_touched_per_layer"] == pytest.approx(touched)
        assert list(t["ttft_s"]) == list(t["prefill_tokens_per_s"]) == ["1024", "8192", "32768"]
        ttft = list(t["ttft_s"].values())
        assert ttft == sorted(ttft)
        for n, s in t["ttft_s"].items():
            assert t["prefill_tokens_per_s"][n] == pytest.approx(int(n) / s)
    # Scout at batch 64 touches nearly every expert: most of its weights read for 64 tokens.
    assert scout["throughput"]["assumptions"]["experts_touched_per_layer"]["64"] > 15.7


def test_the_plan_prints_throughput(scout, kimi):
    scout_text, kimi_text = plan.format_plan(scout), plan.format_plan(kimi)
    for fragment in ("throughput  bounds on paper (docs/plan.md): H200 at 4.8 TB/s, 989 bf16 TFLOP/s",
                     "batch 1: 290 ($3.83)", "rows 4,096 tokens deep", "--usd-per-device-hour",
                     "prefill     TTFT, one prompt in 256-token chunks",
                     "experts     touched per layer, of 16 (top-1)"):
        assert fragment in scout_text
    for fragment in ("H100 at 3.35 TB/s", "a step of b rows in m + 1 ticks of b/m", "batch 1: 410 ($10.85)",
                     "of 384 (top-8), a micro-batch's rows at a time: 8.0 at batch 1"):
        assert fragment in kimi_text


def test_the_price_is_a_flag():
    p = plan_json("--model", str(SCOUT), "--mesh", "h200x2-llama4-scout", "--no-compile", "--usd-per-device-hour",
                  "3.5", "--max-batch", "16")
    t = p["throughput"]
    assert t["assumptions"]["usd_per_device_hour"] == 3.5
    assert t["assumptions"]["usd_per_device_hour_source"] == "--usd-per-device-hour"
    assert list(t["decode_tokens_per_s"]) == ["1", "8", "16"]  # --max-batch replaces 64
    tps = t["decode_tokens_per_s"]["1"]
    assert t["usd_per_million_output_tokens"]["1"] == pytest.approx(3.5 * 2 / (tps * 3600) * 1e6)
    assert "$3.5 per device-hour)" in plan.format_plan(p)


def test_without_the_device_s_peaks_there_is_no_throughput(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    limits = plan.Limits(max_batch=4, prefill_budget=32, max_context=64)
    p = plan.plan(tmp_path, meshes.resolve("single"), compile=False, device_memory_gib=1.0, limits=limits)
    assert p["throughput"] is None
    assert "throughput  not on paper" in plan.format_plan(p)
    peaks = meshes.MeshSpec(name="chip", device_memory_tb_per_s=1.0, device_bf16_tflops=100.0)
    p = plan.plan(tmp_path, peaks, compile=False, device_memory_gib=1.0, limits=limits)
    assert list(p["throughput"]["decode_tokens_per_s"]) == ["1", "4"]
    assert p["throughput"]["ttft_s"] == {}  # the tiny model's 256 positions take none of the stated prompts
    with pytest.raises(JfireError, match="--usd-per-device-hour must be > 0"):
        plan.plan(tmp_path, peaks, compile=False, device_memory_gib=1.0, limits=limits, usd_per_device_hour=0)
    bad = tmp_path / "bad.toml"
    bad.write_text("[mesh]\ntp = 2\n\n[device]\nmemory_gib = 80\nmemory_tb_per_s = -3\n")
    with pytest.raises(JfireError, match=r"\[device\] memory_tb_per_s must be a positive number"):
        meshes.MeshSpec.from_toml(bad)


def test_the_readme_s_prefill_budget_figures():
    """What the README says a larger prefill budget does to a 32,768-token prompt's TTFT."""
    text = " ".join(README.read_text().split())
    shown = re.search(r"--prefill-budget 2048 --max-context 32768`, which still fit, give "
                      r"Scout ([\d.]+) s and Kimi ([\d.]+) s", text)
    assert shown
    for model, mesh, figure in ((SCOUT, "h200x2-llama4-scout", shown[1]), (KIMI, "h100x8-kimi-k2", shown[2])):
        p = plan_json("--model", str(model), "--mesh", mesh, "--no-compile", "--prefill-budget", "2048",
                      "--max-context", "32768")
        assert p["fits"] and f"{p['throughput']['ttft_s']['32768']:.2f}" == figure
