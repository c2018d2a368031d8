"""The model-family seam holds: outside jfire/models/ nothing reads a family's own fields.

The engine, sharding, the page pool, the KV transfer, checkpoints and the HTTP service may use
only the `Family` interface (declarations, forward functions) and the fields every family
shares (vocabulary, context, special tokens).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from jfire.models.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
SHARED_FIELDS = {"vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_ids"}


def family_fields() -> set[str]:
    fields = set()
    for cls in FAMILIES.values():
        fields |= {f.name for f in dataclasses.fields(cls)}
    return fields - SHARED_FIELDS


# The vision towers are model code too (their `cfg` is a tower's own config, not a family's).
VISION_TOWERS = {ROOT / "jfire" / "vision" / "llama4.py", ROOT / "jfire" / "vision" / "kimi_k25.py"}


def engine_sources() -> list[Path]:
    files = [p for p in (ROOT / "jfire").rglob("*.py") if "models" not in p.relative_to(ROOT / "jfire").parts]
    return [p for p in files if p not in VISION_TOWERS] + list((ROOT / "serve").rglob("*.py"))


def test_no_module_outside_models_reads_family_fields():
    fields = family_fields()
    assert {"num_kv_heads", "head_dim", "num_experts", "hidden_size"} <= fields  # the check checks something
    pattern = re.compile(r"\b(?:cfg|config|model\.config|self\.cfg|engine\.cfg)\.(" + "|".join(sorted(fields)) + r")\b")
    offenders = []
    for path in engine_sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "family fields read outside jfire/models/:\n" + "\n".join(offenders)


def test_no_module_outside_models_imports_a_family():
    pattern = re.compile(r"from jfire\.models\.(llama|llama4)\b|import jfire\.models\.(llama|llama4)\b")
    offenders = [str(p.relative_to(ROOT)) for p in engine_sources() if pattern.search(p.read_text())]
    assert not offenders, offenders
