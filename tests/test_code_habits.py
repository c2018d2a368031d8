"""The code's habits, enforced: ruff (lint and format) and mypy on jfire/ and serve/, as
configured in pyproject.toml. mypy keeps a baseline of the errors the code had when the checker
came in (tests/data/mypy-baseline.txt, one `path: message [code]` per error, line numbers left
out so that edits elsewhere do not move it): no new error may appear, and an error fixed must
leave the baseline too, so it only shrinks. After fixing some:

    .venv/bin/python tests/test_code_habits.py --write-baseline
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tests" / "data" / "mypy-baseline.txt"
CHECKED = ["jfire", "serve"]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)


def mypy_errors() -> list[str]:
    out = run("mypy", *CHECKED).stdout
    errors = [re.sub(r"^([^:]+):\d+: error: ", r"\1: ", line) for line in out.splitlines() if ": error: " in line]
    return sorted(errors)


def test_ruff_finds_nothing():
    check = run("ruff", "check", *CHECKED)
    assert check.returncode == 0, check.stdout[-5000:]


def test_the_code_is_formatted():
    check = run("ruff", "format", "--check", *CHECKED)
    assert check.returncode == 0, check.stdout[-5000:] + "\n(run .venv/bin/ruff format jfire serve)"


def test_type_errors_only_ever_go_away():
    now = collections.Counter(mypy_errors())
    baseline = collections.Counter(BASELINE.read_text().splitlines())
    new, fixed = now - baseline, baseline - now
    assert not new, "new type errors:\n" + "\n".join(sorted(new.elements()))
    assert not fixed, ("fixed, still in the baseline (run this file with --write-baseline):\n"
                       + "\n".join(sorted(fixed.elements())))


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-baseline"]:
        errors = mypy_errors()
        BASELINE.write_text("".join(e + "\n" for e in errors))
        print(f"wrote {len(errors)} errors to {BASELINE.relative_to(ROOT)}")
