"""File names a checkpoint gives about itself stay inside it: a sharded index whose weight map
points at an absolute path or climbs out with `..` is refused, naming the index and the entry,
by every reader of such an index (the model's, an EAGLE-3 head's, Llama 4's vision tower's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jfire.checkpoint.eagle3_load import _open_weights
from jfire.checkpoint.paths import file_in, read_weight_map
from jfire.checkpoint.sources import HFDirSource
from jfire.errors import JfireError
from jfire.vision.llama4 import _SafetensorsDir
from tests.tiny_models import COMMON

HOSTILE = {
    "climbs": ("../outside.safetensors", ["'../outside.safetensors'", "'..'"]),
    "climbs_from_a_subfolder": ("shards/../../outside.safetensors", ["'shards/../../outside.safetensors'", "'..'"]),
    "absolute": ("/etc/passwd", ["'/etc/passwd'", "absolute path"]),
}


def _checkpoint(tmp_path: Path, shard: str) -> Path:
    """A directory with a Llama config and an index mapping one tensor to `shard` (and
    a file where `shard` leads, so that only the check can stop it being opened)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                   **COMMON}))
    (tmp_path / "outside.safetensors").write_bytes(b"not for jfire to open")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00001.safetensors", "lm_head.weight": shard}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("reader", ["hf_dir", "eagle3", "llama4_vision"])
def test_a_weight_map_entry_outside_the_checkpoint_is_refused(tmp_path, case, reader):
    shard, fragments = HOSTILE[case]
    model = _checkpoint(tmp_path, shard)
    read = {"hf_dir": HFDirSource, "eagle3": _open_weights, "llama4_vision": _SafetensorsDir}[reader]
    with pytest.raises(JfireError) as refused:
        read(model)
    message = str(refused.value)
    assert str(model / "model.safetensors.index.json") in message and "weight_map['lm_head.weight']" in message
    for fragment in fragments:
        assert fragment in message


def test_a_weight_map_inside_the_checkpoint_is_read_as_given(tmp_path):
    model = _checkpoint(tmp_path, "shards/./model-00002-of-00002.safetensors")
    assert read_weight_map(model) == {
        "model.embed_tokens.weight": model / "model-00001-of-00001.safetensors",
        "lm_head.weight": model / "shards/model-00002-of-00002.safetensors",
    }


@pytest.mark.parametrize("name", ["", None, 3, "a\0b", "//server/share", "sub/../../x"])
def test_names_that_are_not_files_of_the_directory_are_refused(tmp_path, name):
    with pytest.raises(JfireError, match=r"index\.json: weight_map\['w'\]"):
        file_in(tmp_path, name, tmp_path / "index.json", "weight_map['w']")


def test_an_index_without_a_weight_map_is_refused_with_its_name(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a.safetensors"]}))
    with pytest.raises(JfireError, match="has no 'weight_map' object"):
        read_weight_map(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(JfireError, match="is not valid JSON"):
        read_weight_map(tmp_path)
