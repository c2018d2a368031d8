"""DeepSeek-V3's MTP layer as a draft model (jfire.models.mtp) against transformers' own MTP
speculation (`generate(use_mtp=True)`, `MtpModel`), torch on CPU, float32.

transformers' main model does not hold the MTP layer, so the tiny checkpoint gets one the
way DeepSeek ships it: transformers' `MtpModel` built beside the tiny model, its weights
randomised and written as `model.layers.{num_hidden_layers}.*` (experts per expert,
`shared_head.norm`, copies of the embedding and head), which `MtpModel.from_pretrained`
reads back with transformers' own renaming. The one change to transformers: the pattern
DeepSeek-V3 uses to find MTP tensors names layer 61, the released model's; here it names
the tiny model's layer 4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.cache_utils import MtpCache
from transformers.generation.candidate_generator import MTPCandidateGenerator
from transformers.modeling_layers import MtpModel

from jfire.checkpoint.load import load_model
from jfire.errors import JfireError
from jfire.models import family, mtp
from tests.tiny_models import build_tiny_hf_model, hf_text_model

FAMILY = "deepseek_v3"  # 4 layers, 2 dense: the MTP layer (index 4) has routed experts
PROMPT_LEN, NEW_TOKENS = 9, 12
# Relative error (2-norm) of each position's logits or hidden state, float32 throughout. Fed
# transformers' own hidden states, the MTP layer agrees to 7e-7; end to end, from jfire's own
# target, whose hidden states differ from transformers' by 2e-6, the drafts' logits agree to
# 2e-6. Both bounds leave about ten times that.
TOL_LAYER, TOL_END_TO_END = 1e-5, 2e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_close_per_position(got, want, tol, what=""):
    for t in range(want.shape[0]):
        err = rel_err(got[t], want[t])
        assert err < tol, f"{what} position {t}: relative error {err:.2e}"


# -- a tiny DeepSeek-V3 checkpoint with its MTP layer --------------------------------------------


def mtp_checkpoint_tensors(model, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP layer for `model`, named as DeepSeek-V3 ships it."""
    layer = MtpModel(model, 1)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in [*layer.named_parameters(), *layer.named_buffers()]:
            if not name.startswith("layers.0."):
                continue  # the target's embedding and head, shared
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))  # the tiny models' initializer_range
    pre, out = f"model.layers.{model.config.num_hidden_layers}.", {}
    for name, value in layer.state_dict().items():
        if not name.startswith("layers.0."):
            continue
        rest = name.removeprefix("layers.0.").removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        if rest.endswith("experts.gate_up_proj"):  # fused in memory [x, 2f, e], per expert on disk
            base, f = rest.removesuffix("gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{pre}{base}{e}.gate_proj.weight"] = value[e, :f].contiguous()
                out[f"{pre}{base}{e}.up_proj.weight"] = value[e, f:].contiguous()
        elif rest.endswith("experts.down_proj"):
            base = rest.removesuffix("down_proj")
            for e in range(value.shape[0]):
                out[f"{pre}{base}{e}.down_proj.weight"] = value[e].contiguous()
        else:
            out[pre + rest] = value.contiguous()
    out[pre + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    out[pre + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return out


def save_with_mtp(path: Path, seed: int = 0) -> Path:
    model = build_tiny_hf_model(FAMILY, seed=seed)
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, **mtp_checkpoint_tensors(model, seed + 1)}, path / "model.safetensors", {"format": "pt"})
    return path


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> Path:
    return save_with_mtp(tmp_path_factory.mktemp("deepseek_mtp"))


@pytest.fixture(scope="module")
def reference(mtp_dir):
    """transformers on the checkpoint: a greedy `generate(use_mtp=True)` with each round's
    MTP candidate recorded, and the MTP layer's uncached forward over the whole sequence."""
    rounds = []
    draft = MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = draft(self, input_ids, *args, **kwargs)
        if logits is not None:  # (sequence length, the drafted token, its logits)
            n = input_ids.shape[1]
            rounds.append((n, int(ids[0, n]), logits[0, -1].numpy()))
        return ids, logits

    prompt = [int(x) for x in np.random.RandomState(2).randint(3, 256, size=PROMPT_LEN)]
    with pytest.MonkeyPatch.context() as patch:
        layer = rf"model\.layers\.{json.loads((mtp_dir / 'config.json').read_text())['num_hidden_layers']}\..*"
        patch.setattr(transformers.DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected", [layer])
        patch.setattr(MTPCandidateGenerator, "get_candidates", recording)
        model = hf_text_model(mtp_dir)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, use_mtp=True)
            plain = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
            seq = out[0].tolist()
            ids = torch.tensor([seq])
            hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # what MTPCandidateGenerator feeds
            layers = MtpModel.from_pretrained(model)
            # Pairs (h[t], x[t + 1]) at transformers' positions t + 1, all at once.
            mtp_hidden = layers.forward_layer(
                0,
                hidden[:, :-1],
                torch.arange(1, len(seq))[None],
                MtpCache(config=model.config.get_mtp_config()),
                input_ids=ids[:, 1:],
            )
            logits = layers._project_to_logits(mtp_hidden)
    assert plain.tolist() == out.tolist()  # speculation is lossless: the drafts were judged
    assert len(rounds) >= NEW_TOKENS // 2
    return dict(
        seq=seq,
        rounds=rounds,
        hidden=hidden[0].numpy(),
        mtp_hidden=mtp_hidden[0].numpy(),
        logits=logits[0].numpy(),
    )


@pytest.fixture(scope="module")
def jfire_mtp(mtp_dir):
    model = load_model(str(mtp_dir), "float32")
    cfg, params = mtp.load_mtp(model)
    return model, cfg, params


# -- jfire's side ---------------------------------------------------------------------------------

PAGE_SIZE = 4


_forward = jax.jit(mtp.mtp_forward, static_argnums=0)


def target_hidden(model, seq) -> np.ndarray:
    """jfire's target over the whole sequence: its last hidden state, after the final norm."""
    cfg = model.config
    cache = family.init_cache(cfg, 1, 64, jnp.float32)
    table = cache.pop("page_table")
    run = jax.jit(lambda p, tok, pos, pages, tab: cfg.decoder(p, tok, pos, pages, tab)[0])
    n = len(seq)
    return np.asarray(run(model.params, jnp.asarray([seq]), jnp.arange(n)[None], cache, table))[0]


def run_mtp(cfg, params, main_params, hidden, seq, *, chunks=None, page_table=None, num_pages=8):
    """MTP logits and hidden [n - 1, ...] for the pairs (hidden[t], seq[t + 1]) at positions
    t = 0 .. n - 2, fed `chunks` tokens per call (all at once by default), row 0 of a batch of
    2 whose row 1 is padding, through `page_table` (row 0's pages)."""
    n = len(seq) - 1
    chunks = chunks or [n]
    width = -(-n // PAGE_SIZE)
    table = np.full((2, width), num_pages - 1, np.int32)
    table[0] = page_table if page_table is not None else np.arange(width)
    cache = mtp.init_cache(cfg, num_pages, PAGE_SIZE, jnp.float32)
    logits, out, start = [], [], 0
    for size in chunks:
        pos = np.full((2, size), -1, np.int32)
        pos[0] = np.arange(start, start + size)
        tok = np.zeros((2, size), np.int32)
        tok[0] = seq[start + 1 : start + 1 + size]
        h = np.zeros((2, size, hidden.shape[-1]), np.float32)
        h[0] = hidden[start : start + size]
        lg, hid, cache = _forward(cfg, params, main_params, jnp.asarray(h), tok, pos, cache, table)
        logits.append(np.asarray(lg)[0])
        out.append(np.asarray(hid)[0])
        start += size
    assert start == n
    return np.concatenate(logits), np.concatenate(out)


# -- the tests ------------------------------------------------------------------------------------


def test_mtp_layer_logits_match_transformers(reference, jfire_mtp):
    """Fed transformers' hidden states, every position's MTP logits and output hidden state
    equal transformers' MtpModel's (the layer alone, no target rounding in between)."""
    model, cfg, params = jfire_mtp
    assert cfg.kind == "moe" and cfg.layer == 4
    logits, out = run_mtp(cfg, params, model.params, reference["hidden"], reference["seq"])
    assert_close_per_position(logits, reference["logits"], TOL_LAYER, "logits")
    assert_close_per_position(out, reference["mtp_hidden"], TOL_LAYER, "out_hidden")


def test_draft_tokens_match_transformers_generate(reference, jfire_mtp):
    """End to end, from jfire's own target: the token the MTP drafts after each sequence
    length equals the candidate transformers' MTPCandidateGenerator proposed in that round of
    `generate(use_mtp=True)`, and its logits agree."""
    model, cfg, params = jfire_mtp
    seq = reference["seq"]
    hidden = target_hidden(model, seq)
    assert_close_per_position(hidden, reference["hidden"], TOL_END_TO_END, "target hidden")
    logits, _ = run_mtp(cfg, params, model.params, hidden, seq)
    for n, drafted, want in reference["rounds"]:
        # A round over n tokens drafts token n from the pair (h[n - 2], x[n - 1]).
        assert int(np.argmax(logits[n - 2])) == drafted, f"round at length {n}"
        assert rel_err(logits[n - 2], want) < TOL_END_TO_END, f"round at length {n}"


def test_cached_chunks_equal_one_pass(reference, jfire_mtp):
    """A prefill chunk, then decode-sized steps and a verify-sized chunk, through scattered
    pages, give the logits of one pass: entries are written before the layer attends, and
    each step sees exactly the earlier entries."""
    model, cfg, params = jfire_mtp
    hidden, seq = reference["hidden"], reference["seq"]
    whole, _ = run_mtp(cfg, params, model.params, hidden, seq)
    n = len(seq) - 1
    chunks = [PROMPT_LEN - 1, 1, 1, 3] + [1] * (n - PROMPT_LEN - 4)
    pages = np.array([6, 2, 5, 0, 3, 1])[: -(-n // PAGE_SIZE)]
    chunked, _ = run_mtp(cfg, params, model.params, hidden, seq, chunks=chunks, page_table=pages)
    assert_close_per_position(chunked, whole, TOL_LAYER, "chunked")


def test_load_respects_dtype(mtp_dir, jfire_mtp):
    _, cfg, params = jfire_mtp
    assert params["eh_proj"].dtype == jnp.float32 and params["eh_proj"].shape == (128, 64)
    bf16_cfg, bf16 = mtp.load_mtp(mtp_dir, "bfloat16")
    assert bf16_cfg == cfg
    assert bf16["eh_proj"].dtype == jnp.bfloat16 and bf16["layer"]["we_gate"].dtype == jnp.bfloat16
    assert bf16["layer"]["router_bias"].dtype == jnp.float32  # kept float32, as the target's
    np.testing.assert_array_equal(
        np.asarray(bf16["eh_proj"], np.float32),
        np.asarray(params["eh_proj"].astype(jnp.bfloat16), np.float32),
    )


def test_checkpoint_without_mtp_layer_is_a_clear_error(mtp_dir, tmp_path, tiny_hf_dir):
    plain = tmp_path / "plain"
    build_tiny_hf_model(FAMILY).save_pretrained(plain)
    with pytest.raises(JfireError, match="no MTP layer.*no tensors under model.layers.4"):
        mtp.load_mtp(plain)

    none = tmp_path / "none"
    shutil.copytree(plain, none)
    config = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(JfireError, match="no MTP layer.*num_nextn_predict_layers to 0"):
        mtp.load_mtp(none)

    with pytest.raises(JfireError, match="DeepSeek-V3's"):
        mtp.load_mtp(tiny_hf_dir("llama2"))
