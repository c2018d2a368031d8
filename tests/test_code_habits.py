"""The code's habits, enforced: ruff (lint and format) and mypy on jfire/ and serve/, as
configured in pyproject.toml. mypy keeps a baseline of the errors the code had when the checker
came in (tests/data/mypy-baseline.txt, one `path: message [code]` per error, line numbers left
out so that edits elsewhere do not move it): no new error may appear, and an error fixed must
leave the baseline too, so it only shrinks. After fixing some:

    .venv/bin/python tests/test_code_habits.py --write-baseline
"""

from __future__ import annotations

import ast
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


def modules() -> dict[str, Path]:
    """Every module of jfire/ and serve/ by dotted name (a package by its own name)."""
    found = {}
    for package in CHECKED:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `name` imports anywhere in its file (inside functions and
    `if TYPE_CHECKING:` too), with the packages above each (importing a module runs them)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            parts = target.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known)
    return {t for t in out if t != name and not name.startswith(t + ".")}


def test_no_import_cycles():
    """An import cycle hidden behind an import inside a function still ties the modules into one
    piece: none among jfire/ and serve/."""
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def cycle_from(start: str) -> list[str] | None:
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
        return None

    for name in sorted(graph):
        if name not in state:
            found = cycle_from(name)
            assert found is None, " -> ".join(found)


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
