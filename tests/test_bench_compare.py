"""`jfire bench --compare`'s own pieces that decide what it measures: the F32 GGUF it hands
llama.cpp holds exactly the values jfire loads from the default model's Q4_1 file, with the
same metadata (so llama.cpp builds the same model and tokenizer)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from jfire.bench_compare import format_compare, write_f32_gguf
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


def test_the_table_names_every_engine_and_the_roofline():
    figures = dict(startup_s=1.0, ttft_s=0.5, decode_tps=20.0, conc16_tps=90.0, peak_rss_gb=1.5,
                   roofline_fraction=0.4)
    text = format_compare({"median": {"jfire": {**figures, "startup_cold_s": 9.0}, "llama.cpp F32": figures},
                           "roofline_decode_tps": 50.0, "bandwidth_gbs": 27.0, "rounds": 3, "machine": "2 cores"})
    assert "jfire" in text and "llama.cpp F32" in text and "(9.0 s cold) 1.0 s" in text
    assert "50.0 tokens/s at 27.0 GB/s" in text and "40%" in text


@pytest.mark.parametrize("argv, message", [
    (["bench", "--compare", "--model", "x.gguf"], "--compare measures the default model"),
    (["bench", "--compare", "--rounds", "0"], "--rounds must be >= 1"),
])
def test_compare_refuses_what_it_cannot_measure(argv, message, capsys):
    from jfire.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err
