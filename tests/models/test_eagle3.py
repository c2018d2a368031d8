"""EAGLE-3 draft heads (jfire.models.eagle3) in their released layouts.

A tiny random head is written here in the published tensor names (config.json plus
model.safetensors, a reduced draft vocabulary with its d2t) and loaded through `load_eagle3`;
its draft logits are compared with a float64 numpy forward written below from the paper's
equations and the trainers' code, which calls nothing of jfire: fc over the target's hidden
states, the one layer (both norms, [embedding, hidden] into q/k/v or MLA's down-projections,
causal attention over the draft's own positions, residual on the hidden, MLP), final norm,
lm_head. Two draft steps are chained, the second fed the first's output hidden. Tolerance:
max abs difference of the float32 logits from the float64 ones, 1e-5.

tests/data/eagle3/*.json record the published heads' config keys and tensor names (each with
its source); the tests load a tiny head written with exactly those names.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jfire.checkpoint.eagle3_load import load_eagle3
from jfire.errors import JfireError
from jfire.models.eagle3 import (
    LAYER_PREFIXES,
    Eagle3Config,
    draft_embedding,
    draft_forward,
    fuse,
    init_cache,
    target_logits,
    to_target_ids,
)

LAYOUTS = Path(__file__).resolve().parents[1] / "data" / "eagle3"
TOLERANCE = 1e-5  # max abs, float32 logits against float64
PAGE_SIZE, NUM_PAGES = 4, 10
# Step 1: row 0 holds positions 0..4, row 1 positions 0..2 then padding; each row's pages are
# scattered through the pool.
PAGE_TABLE = np.array([[3, 7, 9], [5, 1, 2]], np.int32)
POSITIONS_1 = np.array([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]], np.int32)

GQA_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 16, "target_hidden_size": 12, "intermediate_size": 24, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
    "vocab_size": 64, "draft_vocab_size": 24, "max_position_embeddings": 256, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
MLA_CONFIG = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_act": "silu",
    "hidden_size": 16, "intermediate_size": 24, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 1, "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 6,
    "qk_rope_head_dim": 8, "v_head_dim": 5, "rms_norm_eps": 1e-5, "vocab_size": 64,
    "draft_vocab_size": 24, "max_position_embeddings": 256, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7},
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True},
}


# -- the released layout, written by hand -------------------------------------------------------


def hf_shapes(hf: dict, layer: str = "midlayer.") -> dict[str, tuple[int, ...]]:
    """Every tensor of an EAGLE-3 head as its HF checkpoint stores it (linears [out, in])."""
    H, F, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    Ht, Vd, nh = hf.get("target_hidden_size", H), hf.get("draft_vocab_size", V), hf["num_attention_heads"]
    n_aux = len((hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    attn = layer + "self_attn."
    shapes = {
        "fc.weight": (H, n_aux * Ht), "embed_tokens.weight": (V, H), "norm.weight": (H,), "lm_head.weight": (Vd, H),
        "d2t": (Vd,), "t2d": (V,), layer + "input_layernorm.weight": (H,), layer + "hidden_norm.weight": (H,),
        layer + "post_attention_layernorm.weight": (H,), layer + "mlp.gate_proj.weight": (F, H),
        layer + "mlp.up_proj.weight": (F, H), layer + "mlp.down_proj.weight": (H, F),
    }
    if "kv_lora_rank" in hf:
        Q, C, R = hf["q_lora_rank"], hf["kv_lora_rank"], hf["qk_rope_head_dim"]
        Dn, Dv = hf["qk_nope_head_dim"], hf["v_head_dim"]
        shapes |= {
            attn + "q_a_proj.weight": (Q, 2 * H), attn + "q_a_layernorm.weight": (Q,),
            attn + "q_b_proj.weight": (nh * (Dn + R), Q), attn + "kv_a_proj_with_mqa.weight": (C + R, 2 * H),
            attn + "kv_a_layernorm.weight": (C,), attn + "kv_b_proj.weight": (nh * (Dn + Dv), C),
            attn + "o_proj.weight": (H, nh * Dv),
        }
    else:
        D, kv = hf.get("head_dim") or H // nh, hf["num_key_value_heads"]
        shapes |= {
            attn + "q_proj.weight": (nh * D, 2 * H), attn + "k_proj.weight": (kv * D, 2 * H),
            attn + "v_proj.weight": (kv * D, 2 * H), attn + "o_proj.weight": (H, nh * D),
        }
    return shapes


def random_tensors(hf: dict, names, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under `names`: norms near 1, matrices scaled by their fan-in, and a draft
    vocabulary of sorted target ids (d2t = id - index, t2d marking them)."""
    rng = np.random.default_rng(seed)
    layer = next(p for p in LAYER_PREFIXES if p + "hidden_norm.weight" in names)
    shapes = hf_shapes(hf, layer)
    V, Vd = hf["vocab_size"], hf.get("draft_vocab_size", hf["vocab_size"])
    used = np.sort(rng.choice(V, Vd, replace=False))
    out = {}
    for name in names:
        shape = shapes[name]
        if name == "d2t":
            out[name] = (used - np.arange(Vd)).astype(np.int64)
        elif name == "t2d":
            out[name] = np.isin(np.arange(V), used)
        elif name.endswith(("norm.weight", "layernorm.weight")):
            out[name] = (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "embed_tokens.weight":
            out[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
    return out


def write_head(path: Path, hf: dict, tensors: dict[str, np.ndarray]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path / "model.safetensors")
    return path


def default_names(hf: dict, layer: str = "midlayer.", embed: bool = True) -> list[str]:
    names = [n for n in hf_shapes(hf, layer) if n not in ("embed_tokens.weight",)]
    return names + (["embed_tokens.weight"] if embed else [])


# -- the float64 reference ------------------------------------------------------------------------


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1 + np.exp(-x))


def yarn_mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_tables(hf: dict, dim: int):
    """(inverse frequencies [dim/2], cos/sin multiplier): plain RoPE, or YaRN as the YaRN paper
    and DeepSeek's reference code define it (frequencies blended over a ramp of dimensions)."""
    base = hf.get("rope_theta", 10000.0)
    extrapolation = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    rope = hf.get("rope_scaling")
    if not rope:
        return extrapolation, 1.0
    factor, orig = rope["factor"], rope["original_max_position_embeddings"]

    def correction(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(rope["beta_fast"])), 0)
    high = min(math.ceil(correction(rope["beta_slow"])), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0, 1)
    inv = extrapolation / factor * ramp + extrapolation * (1 - ramp)
    return inv, yarn_mscale(factor, rope["mscale"]) / yarn_mscale(factor, rope["mscale_all_dim"])


def rotate(x, pos, inv, mult, pairs: bool):
    """RoPE on the last axis: halves (Llama) or adjacent pairs (DeepSeek)."""
    c, s = np.cos(pos * inv) * mult, np.sin(pos * inv) * mult
    if pairs:
        a, b = x[..., 0::2], x[..., 1::2]
        return np.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(x.shape)
    a, b = np.split(x, 2, axis=-1)
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


class Reference:
    """The head in float64 from its HF tensors (y = W x), one row's history of keys and values
    kept per position: each token is appended, then attends to every kept position <= its own."""

    def __init__(self, hf: dict, tensors: dict[str, np.ndarray], layer: str = "midlayer."):
        self.hf, self.eps = hf, hf["rms_norm_eps"]
        self.w = {k.removeprefix(layer): v.astype(np.float64) for k, v in tensors.items()}
        self.mla = "kv_lora_rank" in hf
        self.history: dict[int, list] = {}

    def fuse(self, aux):
        return aux @ self.w["fc.weight"].T

    def step(self, row: int, token: int, pos: int, hidden):
        w, eps = self.w, self.eps
        x_in = np.concatenate([rms(w["embed_tokens.weight"][token], w["input_layernorm.weight"], eps),
                               rms(hidden, w["hidden_norm.weight"], eps)])
        attn = self._mla(row, pos, x_in) if self.mla else self._gqa(row, pos, x_in)
        x = hidden + w["self_attn.o_proj.weight"] @ attn
        h = rms(x, w["post_attention_layernorm.weight"], eps)
        out = x + w["mlp.down_proj.weight"] @ (silu(w["mlp.gate_proj.weight"] @ h) * (w["mlp.up_proj.weight"] @ h))
        logits = w["lm_head.weight"] @ rms(out, w["norm.weight"], eps)
        return logits, out

    def _attend(self, row, pos, q, keys_values, scale):
        """softmax(q . k * scale) over the row's kept positions <= pos; q [heads, d]."""
        self.history.setdefault(row, []).append((pos, keys_values))
        kept = [kv for p, kv in self.history[row] if p <= pos]
        heads = []
        for h in range(q.shape[0]):
            keys = np.stack([kv[0][h] for kv in kept])
            values = np.stack([kv[1][h] for kv in kept])
            scores = keys @ q[h] * scale
            p = np.exp(scores - scores.max())
            heads.append(p @ values / p.sum())
        return np.concatenate(heads)

    def _gqa(self, row, pos, x_in):
        w, hf = self.w, self.hf
        nh, kv, D = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
        inv, mult = rope_tables(hf, D)
        q = rotate((w["self_attn.q_proj.weight"] @ x_in).reshape(nh, D), pos, inv, mult, pairs=False)
        k = rotate((w["self_attn.k_proj.weight"] @ x_in).reshape(kv, D), pos, inv, mult, pairs=False)
        v = (w["self_attn.v_proj.weight"] @ x_in).reshape(kv, D)
        group = nh // kv  # query head h reads KV head h // group
        return self._attend(row, pos, q, (np.repeat(k, group, 0), np.repeat(v, group, 0)), 1 / math.sqrt(D))

    def _mla(self, row, pos, x_in):
        """DeepSeek MLA written out per head (the trainers' form, not jfire's absorbed one)."""
        w, hf, eps = self.w, self.hf, self.eps
        nh, C, R = hf["num_attention_heads"], hf["kv_lora_rank"], hf["qk_rope_head_dim"]
        Dn, Dv = hf["qk_nope_head_dim"], hf["v_head_dim"]
        inv, mult = rope_tables(hf, R)
        q = w["self_attn.q_b_proj.weight"] @ rms(w["self_attn.q_a_proj.weight"] @ x_in,
                                                  w["self_attn.q_a_layernorm.weight"], eps)
        q = q.reshape(nh, Dn + R)
        q = np.concatenate([q[:, :Dn], rotate(q[:, Dn:], pos, inv, mult, pairs=True)], axis=1)
        kv = w["self_attn.kv_a_proj_with_mqa.weight"] @ x_in
        k_rope = rotate(kv[C:], pos, inv, mult, pairs=True)
        up = (w["self_attn.kv_b_proj.weight"] @ rms(kv[:C], w["self_attn.kv_a_layernorm.weight"], eps))
        up = up.reshape(nh, Dn + Dv)
        keys = np.concatenate([up[:, :Dn], np.broadcast_to(k_rope, (nh, R))], axis=1)
        rope = hf["rope_scaling"]
        scale = yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2 / math.sqrt(Dn + R)
        return self._attend(row, pos, q, (keys, up[:, Dn:]), scale)


# -- jfire against the reference ------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def jit_draft(cfg, params, embed, hidden, tokens, positions, cache, page_table):
    return draft_forward(cfg, params, embed, hidden, tokens, positions, cache, page_table)


@functools.partial(jax.jit, static_argnums=0)
def jit_fuse(cfg, params, aux):
    return fuse(cfg, params, aux)


def run_two_steps(cfg, params, embed, aux, tokens_1, tokens_2):
    """Step 1 over the fused target hidden states; step 2 one token a row at the next
    position, fed the output hidden of each row's last step-1 token."""
    cache = init_cache(cfg, NUM_PAGES, PAGE_SIZE, params["fc"].dtype)
    hidden = jit_fuse(cfg, params, jnp.asarray(aux))
    logits_1, out_1, cache = jit_draft(cfg, params, embed, hidden, jnp.asarray(tokens_1), jnp.asarray(POSITIONS_1),
                                       cache, jnp.asarray(PAGE_TABLE))
    last = POSITIONS_1.max(axis=1)
    hidden_2 = out_1[np.arange(2), last][:, None]
    positions_2 = (last + 1)[:, None].astype(np.int32)
    logits_2, out_2, cache = jit_draft(cfg, params, embed, hidden_2, jnp.asarray(tokens_2), jnp.asarray(positions_2),
                                       cache, jnp.asarray(PAGE_TABLE))
    return np.asarray(logits_1), np.asarray(logits_2), np.asarray(out_2)


def reference_two_steps(hf, tensors, layer, aux, tokens_1, tokens_2):
    ref = Reference(hf, tensors, layer)
    logits_1, logits_2, outs = {}, {}, {}
    for row in range(2):
        for j, pos in enumerate(POSITIONS_1[row]):
            if pos < 0:
                continue
            logits_1[row, j], outs[row] = ref.step(row, tokens_1[row, j], pos, ref.fuse(aux[row, j].astype(np.float64)))
        logits_2[row], _ = ref.step(row, tokens_2[row, 0], POSITIONS_1[row].max() + 1, outs[row])
    return logits_1, logits_2


@pytest.mark.parametrize("hf, layer", [(GQA_CONFIG, "midlayer."), (MLA_CONFIG, "layers.0.")], ids=["gqa", "mla"])
def test_two_chained_draft_steps_match_float64_reference(tmp_path, hf, layer):
    tensors = random_tensors(hf, default_names(hf, layer))
    cfg, params = load_eagle3(write_head(tmp_path / "head", hf, tensors))
    assert cfg.attention == ("mla" if "kv_lora_rank" in hf else "gqa") and cfg.layer_prefix == layer
    rng = np.random.default_rng(1)
    aux = rng.standard_normal((2, 5, cfg.num_aux * cfg.target_hidden_size)).astype(np.float32)
    tokens_1 = rng.integers(0, hf["vocab_size"], (2, 5)).astype(np.int32)
    tokens_2 = rng.integers(0, hf["vocab_size"], (2, 1)).astype(np.int32)
    got_1, got_2, _ = run_two_steps(cfg, params, draft_embedding(params), aux, tokens_1, tokens_2)
    want_1, want_2 = reference_two_steps(hf, tensors, layer, aux, tokens_1, tokens_2)
    for (row, j), want in want_1.items():
        assert np.abs(got_1[row, j] - want).max() < TOLERANCE, (row, j)
    for row, want in want_2.items():
        assert np.abs(got_2[row, 0] - want).max() < TOLERANCE, row
    # Draft ids map to the target ids the checkpoint's d2t names.
    draft = jnp.argmax(jnp.asarray(got_2[:, 0]), axis=-1)
    used = np.flatnonzero(tensors["t2d"])
    assert np.array_equal(np.asarray(to_target_ids(params, draft)), used[np.asarray(draft)])
    spread = np.asarray(target_logits(cfg, params, jnp.asarray(got_2[:, 0])))
    assert np.array_equal(np.argmax(spread, axis=-1), used[np.asarray(draft)])
    assert np.isinf(spread).sum() == 2 * (hf["vocab_size"] - hf["draft_vocab_size"])


def test_bfloat16_params_and_the_target_embedding(tmp_path):
    """A head without its own embedding drafts with the target's (given to the loader); in
    bfloat16 its logits stay near the float32 ones."""
    names = default_names(GQA_CONFIG, embed=False)
    tensors = random_tensors(GQA_CONFIG, names + ["embed_tokens.weight"])
    target_embed = tensors.pop("embed_tokens.weight")
    path = write_head(tmp_path / "head", GQA_CONFIG, tensors)
    cfg, p32 = load_eagle3(path, target_embed=target_embed)
    _, p16 = load_eagle3(path, dtype="bfloat16", target_embed=target_embed)
    assert p16["fc"].dtype == jnp.bfloat16 and p16["d2t"].dtype == jnp.int32
    rng = np.random.default_rng(2)
    aux = rng.standard_normal((2, 5, 36)).astype(np.float32)
    tokens_1, tokens_2 = rng.integers(0, 64, (2, 5)).astype(np.int32), rng.integers(0, 64, (2, 1)).astype(np.int32)
    f32 = run_two_steps(cfg, p32, p32["embed"], aux, tokens_1, tokens_2)
    bf16 = run_two_steps(cfg, p16, p16["embed"], aux, tokens_1, tokens_2)
    for a, b in zip(f32[:2], bf16[:2]):
        assert np.isfinite(b).all() and np.abs(a - b).max() < 0.15
    with pytest.raises(JfireError, match="embed_tokens"):
        draft_embedding(load_eagle3(path)[1])


def test_pytorch_bin_reads_as_safetensors(tmp_path):
    import torch
    tensors = random_tensors(GQA_CONFIG, default_names(GQA_CONFIG))
    _, from_st = load_eagle3(write_head(tmp_path / "st", GQA_CONFIG, tensors))
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(GQA_CONFIG))
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, path / "pytorch_model.bin")
    _, from_bin = load_eagle3(path)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), from_st, from_bin))


def test_target_hidden_indices():
    cfg = Eagle3Config.from_hf(GQA_CONFIG)
    assert cfg.target_hidden_indices(32) == (2, 16, 29)  # no ids: every engine's default
    mla = Eagle3Config.from_hf(MLA_CONFIG)
    assert mla.aux_layer_ids == (1, 3, 5)
    assert mla.target_hidden_indices(8) == (2, 4, 6)  # SGLang / trainers: the listed layers' outputs
    assert mla.target_hidden_indices(8, ids_mean="layer_input") == (1, 3, 5)  # vLLM
    with pytest.raises(JfireError, match="outside"):
        mla.target_hidden_indices(4)


# -- the published layouts ------------------------------------------------------------------------

LAYOUT_FILES = sorted(LAYOUTS.glob("*.json"))
TINY = {
    "hidden_size": 16, "intermediate_size": 24, "intermediate_size_mlp": 24, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "q_lora_rank": 12, "kv_lora_rank": 8,
    "qk_nope_head_dim": 6, "qk_rope_head_dim": 8, "v_head_dim": 5, "max_position_embeddings": 256,
}


def layout_names(layout: dict) -> set[str]:
    return set(layout["tensors"]) | set(layout["optional_tensors"])


def tiny_config(layout: dict) -> dict:
    """The layout's config with tiny sizes and without the values no public source confirmed."""
    hf = {k: v for k, v in layout["config"].items() if not (isinstance(v, str) and v.startswith("unconfirmed"))}
    hf.update({k: v for k, v in TINY.items() if k in layout["config"]})
    if "kv_lora_rank" in hf:
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    hf["draft_vocab_size"] = 24 if "d2t" in layout_names(layout) else 64
    hf.setdefault("rms_norm_eps", 1e-5)
    return hf


def test_every_published_head_has_a_layout_file():
    heads = {json.loads(f.read_text())["head"] for f in LAYOUT_FILES}
    assert {"yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "nvidia/Kimi-K2.5-Thinking-Eagle3", "lightseekorg/kimi-k2.5-eagle3",
            "lightseekorg/kimi-k2.5-eagle3-mla"} <= heads
    assert any("Llama-4-Scout" in h for h in heads)
    for f in LAYOUT_FILES:
        assert json.loads(f.read_text())["source"], f.name


@pytest.mark.parametrize("file", LAYOUT_FILES, ids=lambda f: f.stem)
def test_the_loader_reads_each_layouts_names(tmp_path, file):
    """A tiny head written with exactly the layout's tensor names loads, and every one of
    those names is one the loader reads (none left over, none missing)."""
    layout = json.loads(file.read_text())
    names = layout_names(layout)
    hf = tiny_config(layout)
    cfg, params = load_eagle3(write_head(tmp_path / "head", hf, random_tensors(hf, sorted(names))))
    read = {s.hf for s in cfg.param_specs()}
    optional = {s.hf for s in cfg.optional_specs()} | {"t2d"}
    assert read <= names and names - read <= optional, names - read - optional
    assert ("embed" in params) == ("embed_tokens.weight" in names)
    assert bool(jnp.any(params["d2t"] != 0)) == ("d2t" in names)


def _confirmed(file) -> bool:
    layout = json.loads(file.read_text())
    return not any(isinstance(v, str) and v.startswith("unconfirmed") for v in layout["config"].values())


# Only the layouts whose config.json is confirmed from a public source (the unconfirmed one,
# NVIDIA's Kimi K2.5 head, has its tensor names checked above).
@pytest.mark.parametrize("file", [f for f in LAYOUT_FILES if _confirmed(f)], ids=lambda f: f.stem)
def test_published_configs_imply_the_published_shapes(file):
    """Where a layout's config and shapes are confirmed, the config read by `from_hf` declares
    exactly those tensor shapes."""
    layout = json.loads(file.read_text())
    names = layout_names(layout)
    layer = next(p for p in LAYER_PREFIXES if p + "hidden_norm.weight" in names)
    cfg = Eagle3Config.from_hf(layout["config"])
    specs = {s.hf: s.source_shape for s in (*cfg.param_specs(), *cfg.optional_specs())}
    specs = {name.replace("midlayer.", layer, 1): shape for name, shape in specs.items()}
    specs["t2d"] = (cfg.vocab_size,)
    for name in names:
        assert tuple(specs[name]) == tuple((layout["tensors"] | layout["optional_tensors"])[name]), name


# -- bad input -----------------------------------------------------------------------------------


def test_a_missing_tensor_is_named(tmp_path):
    tensors = random_tensors(GQA_CONFIG, default_names(GQA_CONFIG))
    del tensors["midlayer.mlp.up_proj.weight"]
    with pytest.raises(JfireError, match=r"'midlayer\.mlp\.up_proj\.weight' is missing"):
        load_eagle3(write_head(tmp_path / "head", GQA_CONFIG, tensors))


def test_a_hidden_size_the_weights_do_not_have_is_named(tmp_path):
    tensors = random_tensors(GQA_CONFIG, default_names(GQA_CONFIG))
    wrong = {**GQA_CONFIG, "hidden_size": 20, "head_dim": 8}
    with pytest.raises(JfireError, match=r"tensor 'fc\.weight' has shape \(16, 36\) but config\.json implies \(20, 36\)"):
        load_eagle3(write_head(tmp_path / "head", wrong, tensors))


def test_other_bad_heads(tmp_path):
    with pytest.raises(JfireError, match="no config.json"):
        load_eagle3(tmp_path)
    tensors = random_tensors(GQA_CONFIG, default_names(GQA_CONFIG))
    no_d2t = {k: v for k, v in tensors.items() if k != "d2t"}
    with pytest.raises(JfireError, match="no 'd2t'"):
        load_eagle3(write_head(tmp_path / "no_d2t", GQA_CONFIG, no_d2t))
    with pytest.raises(JfireError, match="lacks the required key 'hidden_size'"):
        load_eagle3(write_head(tmp_path / "no_key", {k: v for k, v in GQA_CONFIG.items() if k != "hidden_size"}, tensors))
    with pytest.raises(JfireError, match="norm_output"):
        Eagle3Config.from_hf({**GQA_CONFIG, "norm_output": True})
    cfg, params = load_eagle3(write_head(tmp_path / "ok", GQA_CONFIG, tensors))
    with pytest.raises(JfireError, match="3 target hidden states of 12"):
        fuse(cfg, params, jnp.zeros((1, 1, 16)))
