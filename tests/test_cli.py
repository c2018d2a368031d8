"""The real `jfire` console script, run as a subprocess.

Bad input must come back as one line on stderr starting `jfire: error:`, exit status 2 and
no traceback. Good input must give the tokens the library gives in-process (and, greedy,
the tokens transformers picks). Each start costs about a second of imports, a generation a
few more: the cases are few and share a persistent compilation cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

JFIRE = Path(sys.executable).with_name("jfire")
PROMPT = [5, 6, 7]
MAX_TOKENS = 8


def run_jfire(*args, cwd=None, compile_cache=None) -> subprocess.CompletedProcess:
    cmd = [str(JFIRE)] if JFIRE.exists() else [sys.executable, "-m", "jfire.cli"]
    cmd += [str(a) for a in args]
    if compile_cache is not None:
        cmd += ["--compile-cache", str(compile_cache)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, nothing on stdout, exactly one stderr line `jfire: error: ...` naming the fragments."""
    where = f"\nstdout: {proc.stdout!r}\nstderr: {proc.stderr!r}"
    assert "Traceback" not in proc.stderr, where
    assert proc.returncode == 2, where
    assert proc.stdout == "", where
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jfire: error: "), where
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in the message{where}"
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir) -> Path:
    return tiny_hf_dir("llama2")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> Path:
    """One JAX persistent cache for this module's generations, so only the first compiles."""
    return tmp_path_factory.mktemp("xla")


@pytest.fixture(scope="module")
def bad_models(tiny, tiny_hf_dir, tmp_path_factory) -> Path:
    """Broken copies of the tiny model, one directory each."""
    root = tmp_path_factory.mktemp("bad")
    config = json.loads((tiny / "config.json").read_text())
    weights = (tiny / "model.safetensors").read_bytes()

    def make(name, config_obj=config, data=weights):
        d = root / name
        d.mkdir()
        if config_obj is not None:
            (d / "config.json").write_text(json.dumps(config_obj))
        if data is not None:
            (d / "model.safetensors").write_bytes(data)

    make("no_config", config_obj=None)
    make("gpt2", config_obj={**config, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    # The 8-byte header length and JSON header survive; half the tensor data is gone.
    header_len = int.from_bytes(weights[:8], "little")
    assert 8 + header_len < len(weights) // 2
    make("data_cut", data=weights[: len(weights) // 2])
    # Cut inside the JSON header itself.
    make("header_cut", data=weights[: 8 + header_len // 2])
    make("missing_key", config_obj={k: v for k, v in config.items() if k != "num_attention_heads"})
    make("not_an_object", config_obj=[config])
    # A sharded model (index + shards, read lazily) with its last shard cut short.
    sharded = root / "sharded_cut"
    shutil.copytree(tiny_hf_dir("llama2", max_shard_size="100KB"), sharded)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    shards[-1].write_bytes(shards[-1].read_bytes()[: shards[-1].stat().st_size // 2])
    return root


# -- bad input -------------------------------------------------------------------------------

ERROR_CASES = {
    # name: (arguments after `generate --model MODEL`, model (a bad_models dir, "tiny", or a path), fragments)
    "missing_model_path": ([], "/nonexistent/jfire-model", ["'/nonexistent/jfire-model'", "does not exist"]),
    "no_config_json": ([], "no_config", ["config.json"]),
    "unsupported_architecture": ([], "gpt2", ["'GPT2LMHeadModel'", "LlamaForCausalLM"]),
    "safetensors_data_cut": ([], "data_cut", ["model.safetensors", "truncated"]),
    "safetensors_header_cut": ([], "header_cut", ["model.safetensors", "truncated"]),
    "sharded_safetensors_cut": ([], "sharded_cut", ["model-", "truncated"]),
    "config_missing_key": ([], "missing_key", ["config.json", "'num_attention_heads'"]),
    "config_not_an_object": ([], "not_an_object", ["config.json", "JSON object"]),
    "prompt_longer_than_context": (["--max-context", "4", "--prompt-ids", "1,2,3,4,5"], "tiny",
                                   ["5 tokens", "context holds 4"]),
    "prompt_plus_max_tokens_over_context": (["--max-context", "8", "--prompt-ids", "1,2,3", "--max-tokens", "6"],
                                            "tiny", ["max_tokens", "context of 8", "max_tokens <= 5"]),
    "max_context_not_positive": (["--max-context", "-1", "--prompt-ids", "1"], "tiny", ["--max-context", "-1"]),
    "text_prompt_without_tokenizer": (["--prompt", "hello"], "tiny", ["tokenizer", "--prompt-ids"]),
    "chat_without_tokenizer": (["--chat", "hello"], "tiny", ["tokenizer", "--prompt-ids"]),
    "malformed_prompt_ids": (["--prompt-ids", "1,x,3"], "tiny", ["--prompt-ids", "'1,x,3'"]),
    "prompt_id_outside_vocab": (["--prompt-ids", "5,256"], "tiny", ["256", "vocabulary"]),
    "empty_prompt_ids": (["--prompt-ids", ","], "tiny", ["--prompt-ids"]),
    "prompt_ids_with_a_gap": (["--prompt-ids", "1,,2"], "tiny", ["--prompt-ids", "'1,,2'"]),
    "bad_sampling_value": (["--prompt-ids", "1", "--top-p", "0"], "tiny", ["top_p"]),
    "unknown_flag": (["--prompt-ids", "1", "--bogus-flag"], "tiny", ["--bogus-flag"]),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_input_is_one_line_error(case, tiny, bad_models):
    extra, model, fragments = ERROR_CASES[case]
    if model == "tiny":
        model_path = tiny
    elif model.startswith("/"):
        model_path = model
    else:
        model_path = bad_models / model
    if not any(a in extra for a in ("--prompt-ids", "--prompt", "--chat")):
        extra = extra + ["--prompt-ids", "1,2"]
    assert_user_error(run_jfire("generate", "--model", model_path, *extra), *fragments)


def test_usage_errors_without_a_subcommand():
    assert_user_error(run_jfire("--bogus-flag"), "command")
    assert_user_error(run_jfire("generate", "--model", "x"), "--prompt-ids")  # no prompt given


# -- good input ------------------------------------------------------------------------------


def generate_json(model, *extra, compile_cache) -> dict:
    # The tiny model runs a few tokens: compiled quickly, here and in the library's engine below.
    proc = run_jfire("generate", "--model", model, "--prompt-ids", ",".join(map(str, PROMPT)),
                     "--max-tokens", MAX_TOKENS, "--json", "--quick-compile", *extra, compile_cache=compile_cache)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    out = json.loads(lines[0])
    assert out["prompt_ids"] == PROMPT
    return out


@pytest.fixture(scope="module")
def greedy_from_hf(tiny, compile_cache) -> dict:
    return generate_json(tiny, compile_cache=compile_cache)


def in_process(model_dir, sampling_list) -> list[list[int]]:
    """The same requests through the library's engine in this process."""
    from jfire.checkpoint.load import load_model
    from jfire.engine import Engine, EngineConfig

    model = load_model(str(model_dir), "float32")
    config = EngineConfig(max_batch=1, max_prefill_rows=1, aot=False, kv_cache_bytes=16 << 20, quick_compile=True)
    with Engine(model, config) as engine:
        return [c.token_ids for c in engine.generate([(PROMPT, s) for s in sampling_list])]


def transformers_greedy(model_dir) -> list[int]:
    """Greedy tokens from transformers recomputing the whole sequence each step (stops at EOS)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    seq, out = list(PROMPT), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            token = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(token)
            seq.append(token)
            if token in (model.config.eos_token_id,):
                break
    return out


def test_generate_json_matches_library_and_transformers(tiny, compile_cache, greedy_from_hf):
    from jfire.sampling import SamplingParams

    greedy = greedy_from_hf
    sampled = generate_json(tiny, "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--seed", "3",
                            compile_cache=compile_cache)
    ref_greedy, ref_sampled = in_process(tiny, [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=3, max_tokens=MAX_TOKENS),
    ])
    assert greedy["token_ids"] == ref_greedy
    assert sampled["token_ids"] == ref_sampled
    assert greedy["token_ids"] == transformers_greedy(tiny)
    assert greedy["text"] is None  # no tokenizer
    assert greedy["finish_reason"] == ("stop" if 2 in greedy["token_ids"] else "length")
    assert len(greedy["token_ids"]) == MAX_TOKENS or greedy["token_ids"][-1] == 2
    # Sampling at 0.9 over a 256-token vocabulary: not the greedy path (guards against the
    # flags being dropped on the way to the engine).
    assert sampled["token_ids"] != greedy["token_ids"]


def test_convert_then_generate_from_checkpoint(tiny, tmp_path, compile_cache, greedy_from_hf):
    dst = tmp_path / "ckpt"
    proc = run_jfire("convert", tiny, dst, "--dtype", "float32", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip() == f"wrote {dst}"
    assert (dst / "jfire.json").is_file()
    assert json.loads((dst / "jfire.json").read_text())["dtype"] == "float32"

    from_ckpt = generate_json(dst, compile_cache=compile_cache)
    assert from_ckpt["token_ids"] == greedy_from_hf["token_ids"]

    # Converting again into the (now non-empty) destination is refused, and leaves it intact.
    before = sorted(p.relative_to(dst) for p in dst.rglob("*"))
    assert_user_error(run_jfire("convert", tiny, dst, "--dtype", "float32", "--no-progress"),
                      str(dst), "not empty")
    assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before


def test_convert_bad_sources(tiny, tmp_path, bad_models):
    assert_user_error(run_jfire("convert", tmp_path / "missing", tmp_path / "out1"), "does not exist")
    assert_user_error(run_jfire("convert", bad_models / "gpt2", tmp_path / "out2"), "'GPT2LMHeadModel'")
    assert not (tmp_path / "out2").exists()


def test_generate_json_reports_where_the_time_went(greedy_from_hf):
    """`timings`: compilation happens before the request (so prefill and decode exclude it), and
    the rates are the token counts over those times."""
    t = greedy_from_hf["timings"]
    assert set(t) == {"load_s", "compile_s", "prefill_s", "ttft_s", "decode_s", "prefill_tokens_per_s",
                      "decode_tokens_per_s"}
    assert all(t[k] >= 0 for k in ("load_s", "compile_s", "prefill_s", "decode_s"))
    assert t["prefill_s"] == t["ttft_s"] == greedy_from_hf["ttft_s"]
    assert t["prefill_tokens_per_s"] == pytest.approx(len(PROMPT) / t["prefill_s"], rel=1e-2)
    decoded = len(greedy_from_hf["token_ids"]) - 1
    assert decoded > 0  # this prompt does not sample EOS first
    # The rate comes from the unrounded time, which lies within half a microsecond of decode_s
    # (a tiny model's few tokens can take a dozen microseconds, where that half is 4%); the
    # rate itself is rounded to 0.01 token/s.
    fastest, slowest = decoded / max(t["decode_s"] - 0.5e-6, 1e-7), decoded / (t["decode_s"] + 0.5e-6)
    assert slowest - 0.01 <= t["decode_tokens_per_s"] <= fastest + 0.01
    # Each time is rounded to the microsecond: the sum is within three half-microseconds.
    assert greedy_from_hf["seconds"] == pytest.approx(t["prefill_s"] + t["decode_s"], abs=2e-6)
