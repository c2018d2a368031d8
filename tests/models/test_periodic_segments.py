"""Layer structure: a model whose layer kinds repeat (Llama 4 Maverick's dense and MoE layers, a
Qwen3-MoE sparse step) is one periodic segment, scanned a period per step, its params stacked per
position of the period and read from the right HF layers; pipeline stages split whole periods.
Uniform models keep their one stack and names. (Declarations only: nothing is compiled here.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jfire.models.family import MeshShape, Segment, segments_of
from jfire.models.registry import config_from_hf

SCOUT = Path(__file__).resolve().parents[1] / "data" / "llama4-scout-17b-16e-instruct" / "config.json"


def maverick_shaped() -> dict:
    """Scout's released config with Maverick's layer pattern: MoE on every second layer."""
    hf = json.loads(SCOUT.read_text())
    hf["text_config"] = {**hf["text_config"], "moe_layers": list(range(1, 48, 2)), "interleave_moe_layer_step": 2}
    return hf


@pytest.mark.parametrize(
    "kinds,want",
    [
        ("mmmm", [("layers", 0, 4, "m", ())]),
        ("dmdmdm", [("layers", 0, 6, "d+m", ("d", "m"))]),
        ("mmmdmmmd", [("layers", 0, 8, "m+m+m+d", ("m", "m", "m", "d"))]),
        # A leftover shorter than a period follows as its own run.
        ("dmdmd", [("layers0", 0, 4, "d+m", ("d", "m")), ("layers1", 4, 1, "d", ())]),
        # Leading dense layers (DeepSeek-V3's pattern) repeat nothing: runs, as before.
        ("ddmmmm", [("layers0", 0, 2, "d", ()), ("layers1", 2, 4, "m", ())]),
        ("dmd", [("layers0", 0, 1, "d", ()), ("layers1", 1, 1, "m", ()), ("layers2", 2, 1, "d", ())]),
    ],
)
def test_segments_of_finds_the_period(kinds, want):
    got = segments_of(list(kinds))
    assert [(s.name, s.first, s.count, s.kind, s.period) for s in got] == want


def test_periodic_segment_stacks_one_subtree_per_position():
    segment = Segment("layers", 0, 8, "m+m+m+d", period=("m", "m", "m", "d"))
    assert segment.steps == 2
    assert [(s.path, s.kind, s.first, s.step, s.count) for s in segment.stacks()] == [
        ("layers.m0", "m", 0, 4, 2),
        ("layers.m1", "m", 1, 4, 2),
        ("layers.m2", "m", 2, 4, 2),
        ("layers.d3", "d", 3, 4, 2),
    ]


def test_maverick_pattern_is_one_period_read_from_its_hf_layers():
    cfg = config_from_hf(maverick_shaped())
    (segment,) = cfg.segments()
    assert (segment.period, segment.steps) == (("dense", "moe"), 24)
    specs = {s.name: s for s in cfg.param_specs()}
    dense, moe = specs["layers.dense0.w_gate"], specs["layers.moe1.we_gate"]
    assert list(dense.layers) == list(range(0, 48, 2)) and dense.shape[0] == 24
    assert list(moe.layers) == list(range(1, 48, 2)) and moe.shape[0] == 24
    assert dense.hf.format(i=dense.layers[1]) == "language_model.model.layers.2.feed_forward.gate_proj.weight"
    # Attention weights of both positions: every model layer read once.
    wq = sorted(i for name in ("layers.dense0.wq", "layers.moe1.wq") for i in specs[name].layers)
    assert wq == list(range(48))
    assert not cfg.mesh_problems(MeshShape(pp=2, tp=8, ep=2))
    assert not cfg.mesh_problems(MeshShape(pp=8))
    assert cfg.mesh_problems(MeshShape(pp=16)) == [
        "pp=16 does not divide the 24 periods of 2 layers (dense, moe) into equal stages (a stage holds whole periods)"
    ]


def test_scout_keeps_one_uniform_stack():
    cfg = config_from_hf(json.loads(SCOUT.read_text()))
    (segment,) = cfg.segments()
    assert (segment.name, segment.count, segment.kind, segment.period) == ("layers", 48, "moe", ())
    assert "layers.we_gate" in {s.name for s in cfg.param_specs()}
    assert cfg.mesh_problems(MeshShape(pp=5)) == ["pp=5 does not divide the 48 layers into equal stages"]


def test_pipeline_refuses_a_period_with_a_leftover_layer():
    hf = maverick_shaped()
    hf["text_config"] = {**hf["text_config"], "num_hidden_layers": 5, "moe_layers": [1, 3]}
    hf["text_config"]["no_rope_layers"] = hf["text_config"]["no_rope_layers"][:5]
    cfg = config_from_hf(hf)
    assert [s.describe() for s in cfg.segments()] == ["2 periods of 2 layers (dense, moe)", "1 dense"]
    assert cfg.mesh_problems(MeshShape(pp=2)) == [
        "pp=2 needs one stack of layers, uniform or one repeating period, but this model has 2 segments "
        "(2 periods of 2 layers (dense, moe), 1 dense)"
    ]
