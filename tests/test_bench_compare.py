"""`jfire bench --compare`'s own pieces that decide what it measures: the F32 GGUF it hands
llama.cpp holds exactly the values jfire loads from the default model's Q4_1 file, with the
same metadata (so llama.cpp builds the same model and tokenizer); llama.cpp and transformers
get the very prompts jfire's waves draw; llama-server runs 16 slots with continuous batching
and is asked for exactly that many greedy tokens; and the greedy agreement is counted and
flagged. (llama-server itself is not started here: it comes with the bench extra, not the
test one.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from jfire import bench_compare as bc
from jfire.bench import run_wave
from jfire.bench_compare import format_compare, write_bf16_gguf, write_f32_gguf
from jfire.checkpoint.default_model import default_gguf_path


def test_f32_gguf_holds_the_dequantized_weights_and_the_same_metadata(tmp_path):
    src = default_gguf_path()
    dst = write_f32_gguf(src, tmp_path / "f32.gguf")
    original, written = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert [t.name for t in written.tensors] == [t.name for t in original.tensors]
    for a, b in zip(original.tensors, written.tensors):
        assert b.tensor_type == gguf.GGMLQuantizationType.F32, b.name
        want = gguf.quants.dequantize(a.data, a.tensor_type)
        assert np.array_equal(np.asarray(b.data).reshape(want.shape), want), b.name
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", gguf.Keys.General.FILE_TYPE}
    fields = lambda r: {k: f.contents() for k, f in r.fields.items() if k not in skip}  # noqa: E731
    assert fields(written) == fields(original)
    assert written.fields[gguf.Keys.General.FILE_TYPE].contents() == gguf.LlamaFileType.ALL_F32


def test_bf16_gguf_holds_the_weights_jfire_bf16_serves(tmp_path):
    """Each matrix of the BF16 GGUF is the float32 value rounded as `--dtype bfloat16` rounds it
    (jnp's float32 -> bfloat16: to nearest, ties to even), bit for bit; 1-D tensors stay float32."""
    import jax.numpy as jnp

    src = default_gguf_path()
    dst = write_bf16_gguf(src, tmp_path / "bf16.gguf")
    original, written = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert written.fields[gguf.Keys.General.FILE_TYPE].contents() == gguf.LlamaFileType.MOSTLY_BF16
    for a, b in zip(original.tensors, written.tensors, strict=True):
        want = gguf.quants.dequantize(a.data, a.tensor_type)
        if want.ndim == 1:
            assert b.tensor_type == gguf.GGMLQuantizationType.F32 and np.array_equal(np.asarray(b.data), want)
            continue
        assert b.tensor_type == gguf.GGMLQuantizationType.BF16, b.name
        rounded = np.asarray(jnp.asarray(want).astype(jnp.bfloat16)).view(np.uint16)
        assert np.array_equal(np.asarray(b.data).view(np.uint16).reshape(want.shape), rounded), b.name


def test_the_table_names_every_engine_the_roofline_and_the_agreement():
    figures = dict(startup_s=1.0, ttft_s=0.5, decode_tps=20.0, conc16_tps=90.0, peak_rss_gb=1.5,
                   roofline_fraction=0.4)
    median = {
        "jfire": {**figures, "startup_cold_s": 9.0, "agree_tokens": 128},
        "llama.cpp F32": {**figures, "agree_tokens": 128},
        "jfire bf16": {**figures, "agree_tokens": 128},
        "llama.cpp BF16": {**figures, "agree_tokens": 90},
        "llama.cpp Q4_1": {k: v for k, v in figures.items() if k != "roofline_fraction"} | {"agree_tokens": 37},
        "transformers (safetensors)": {**figures, "agree_tokens": 37},
    }
    text = format_compare({"median": median, "roofline_decode_tps": 50.0, "bandwidth_gbs": 27.0, "rounds": 3,
                           "machine": "2 cores"})
    rows = {line.split("  ")[0]: line for line in text.splitlines()}
    assert "(9.0 s cold) 1.0 s" in rows["jfire"] and rows["jfire"].endswith("(reference)")
    assert rows["llama.cpp F32"].endswith("agree 128/128")
    assert rows["jfire bf16"].endswith("(reference)")  # the bf16 rows' own reference
    assert rows["llama.cpp BF16"].endswith("90/128 (bfloat16 activations)")  # differs by design: no flag
    assert rows["llama.cpp Q4_1"].endswith("37/128 (8-bit activations)")
    assert "%" not in rows["llama.cpp Q4_1"]  # the float32 roofline does not bound a 4-bit file
    assert rows["transformers (safetensors)"].endswith("DIFFERS at token 38")
    assert "WARNING: transformers (safetensors) computes with jfire's weights" in text
    assert "WARNING" not in format_compare({"median": {k: median[k] for k in ("jfire", "llama.cpp F32")},
                                            "roofline_decode_tps": 50.0, "bandwidth_gbs": 27.0, "rounds": 3,
                                            "machine": "2 cores"})
    assert "50.0 tokens/s at 27.0 GB/s" in text and "40%" in text


def test_the_prompt_lookup_rows_and_their_ratios():
    figures = dict(startup_s=1.0, ttft_s=0.5, decode_tps=20.0, conc16_tps=90.0, peak_rss_gb=1.5, agree_tokens=128)
    median = {
        "jfire": {**figures, "copy_tps": 40.0},
        "jfire suffix": {**figures, "copy_tps": 100.0},  # held to jfire's greedy tokens: speculation is exact
        "llama.cpp F32": {**figures, "copy_tps": 50.0},
        "llama.cpp F32 lookup": {**figures, "copy_tps": 80.0},
        "llama.cpp Q4_1": dict(figures),  # no copy figure: a dash
    }
    text = format_compare({"median": median, "roofline_decode_tps": 50.0, "bandwidth_gbs": 27.0, "rounds": 1,
                           "machine": "2 cores"})
    rows = {line.split("  ")[0]: line for line in text.splitlines()}
    assert "100.0 t/s" in rows["jfire suffix"] and rows["jfire suffix"].endswith("agree 128/128")
    assert "80.0 t/s" in rows["llama.cpp F32 lookup"]
    assert "jfire suffix 2.50x jfire, llama.cpp lookup 1.60x llama.cpp F32; jfire suffix 1.25x llama.cpp lookup" in text
    assert bc.SPECULATIVE_ROWS == {"jfire suffix": "suffix", "llama.cpp F32 lookup": "lookup"}


def test_the_copy_requests_are_the_chat_template_s_and_rated_per_request():
    from jfire.checkpoint.load import load_config_and_tokenizer

    tokenizer = load_config_and_tokenizer("default")[1]
    ids = bc.copy_prompts()
    assert len(ids) == len(bc.COPY_REQUESTS) == 4
    for text, prompt in zip(bc.COPY_REQUESTS, ids):  # the request as the user's turn, the answer to come
        assert text in tokenizer.decode(prompt) and tokenizer.decode(prompt).endswith("assistant\n")
    # Two requests of 5 and 3 tokens, 1.0 s and 0.5 s from their first token to their last.
    assert bc.batch1_rate([[0.0, 0.25, 0.5, 0.75, 1.0], [5.0, 5.25, 5.5]]) == (4 + 2) / 1.5


def test_leading_agreement_counts_the_shared_prefix():
    assert bc.leading_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert bc.leading_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2  # what follows a difference is not counted
    assert bc.leading_agreement([5, 2], [1, 2]) == 0
    assert bc.leading_agreement([1, 2, 3], [1, 2]) == 2


class _RecordingEngine:
    """Just enough of an Engine for `run_wave`: records the prompts and finishes each at once."""

    vocab_size = 49152

    def __init__(self):
        self.prompts = []

    def stats(self):
        return {}

    def submit(self, ids, sampling, on_output):
        self.prompts.append(ids)
        on_output(type("Out", (), {"token_ids": [7] * sampling.max_tokens, "finished": True})())


def test_the_other_engines_get_the_prompts_jfire_s_waves_draw():
    one, many = bc.prompts(_RecordingEngine.vocab_size)
    alone, together = _RecordingEngine(), _RecordingEngine()
    run_wave(alone, 1, bc.PROMPT_LEN, bc.DECODE_TOKENS + 1, seed=0)  # as `_jfire` calls it
    run_wave(together, bc.CONC, bc.CONC_PROMPT, bc.CONC_TOKENS, seed=1)
    assert alone.prompts == [one] and together.prompts == many
    assert len(one) == 512 and len(many) == 16 and {len(p) for p in many} == {128}


def test_llama_server_runs_16_slots_with_continuous_batching_and_room_for_each_request():
    cmd = bc.llama_server_command("/bin/llama-server", "m.gguf", 8123, threads=2, flash_attn=False)
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert cmd[0] == "/bin/llama-server" and flag("--model") == "m.gguf" and flag("--port") == "8123"
    assert flag("--parallel") == "16" and "--cont-batching" in cmd and "--no-webui" in cmd
    # --ctx-size is split among the slots: each must hold a 512-token prompt and 129 new tokens
    assert int(flag("--ctx-size")) // 16 >= bc.PROMPT_LEN + bc.DECODE_TOKENS + 1
    assert int(flag("--batch-size")) >= 16 * bc.CONC_PROMPT  # the 16 prompts prefill together
    assert flag("--threads") == flag("--threads-batch") == "2"
    assert flag("--flash-attn") == "off"  # llama.cpp's faster decode on this CPU; "on" for the other row
    with_fa = bc.llama_server_command("/bin/llama-server", "m.gguf", 8123, threads=2, flash_attn=True)
    assert with_fa[with_fa.index("--flash-attn") + 1] == "on"
    assert "--no-repack" in cmd  # llama.cpp's AMX path crashes on this machine


def test_llama_server_is_asked_for_exactly_n_greedy_tokens_after_the_ids():
    r = bc.completion_request([11, 12, 13], 128, stream=True)
    assert r["prompt"] == [11, 12, 13] and r["n_predict"] == 128 and r["ignore_eos"] and r["stream"]
    assert r["temperature"] == 0 and r["top_k"] == 1 and r["samplers"] == ["top_k"] and r["repeat_penalty"] == 1
    assert r["return_tokens"] and not r["cache_prompt"]


@pytest.mark.parametrize("argv, message", [
    (["bench", "--compare", "--model", "x.gguf"], "--compare measures the default model"),
    (["bench", "--compare", "--rounds", "0"], "--rounds must be >= 1"),
])
def test_compare_refuses_what_it_cannot_measure(argv, message, capsys):
    from jfire.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err
