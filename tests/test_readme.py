"""The README's examples, kept true: every shell command in it either runs here as written
(after the set-up command the README names for it) and prints what the README shows after
it, or is listed in SHOWN_ONLY with the reason it is not run here.

Commands are the lines of ```sh blocks (continuation lines joined, comments dropped) and the
`$ ` lines of plain blocks, whose following lines are the output the README shows: every
shown line must appear in that order in what the command prints, `...` standing for any
text within a line, and a line of just `...` for any number of lines."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# (pattern a command starts with, why the tests do not run it as written)
SHOWN_ONLY = [
    (r"bash scripts/setup\.sh", "the set-up: .ci/run runs it on a fresh clone before the suite"),
    (r"\.venv/bin/python -m pytest", "the test suite itself"),
    (r"\.venv/bin/jfire serve", "a server runs until it is stopped: tests/serve start real servers and "
                                "tests/test_lockstep_groups.py a group spanning processes"),
    (r"\.venv/bin/jfire launch", "a deployment runs until it is stopped: tests/disagg launch the shipped ones"),
    (r"curl ", "needs a running server: tests/serve/test_openai_api.py sends this request to one"),
    (r"\.venv/bin/hf ", "downloads from the Hugging Face Hub, which the tests' machine cannot reach"),
    (r"\.venv/bin/jfire convert models/", "converts the model the line above downloads; tests/checkpoint "
                                          "convert tiny models of every family"),
    (r"\.venv/bin/jfire bench", "minutes of benchmark: tests/test_bench_compare.py checks its parts"),
    (r"\.venv/bin/python scripts/", "benchmarks and soaks: minutes each, their figures are in the README"),
    (r"sbatch |scripts/launch_ssh\.py", "cluster launchers: tests/disagg run their commands on this machine"),
]

# The commands that generate tokens run with --quick-compile appended (the README leaves it
# out: it trades decode speed for compile time, right for a test and wrong for a user).
QUICK = re.compile(r"^\.venv/bin/jfire generate ")


def blocks(text: str):
    """(language, README line of the block's first line, the block's lines) of each fenced block."""
    lines, i = text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)$", lines[i])
        i += 1
        if not fence:
            continue
        body_start = i
        while lines[i] != "```":
            i += 1
        yield fence.group(1), body_start, lines[body_start:i]
        i += 1


def commands(text: str) -> list[tuple[int, str, list[str] | None]]:
    """(README line, command, the output lines shown after it or None) for every command."""
    found = []
    for language, body_start, body in blocks(text):
        if language == "sh":
            joined, start = "", None
            for n, line in enumerate(body, body_start + 1):
                start = start or n
                joined += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
                if line.endswith("\\"):
                    continue
                command = _without_comment(joined).strip()
                if command:
                    found.append((start, command, None))
                joined, start = "", None
        elif language == "":
            for n, line in enumerate(body):
                if line.startswith("$ "):
                    shown = []
                    for rest in body[n + 1:]:
                        if rest.startswith("$ "):
                            break
                        shown.append(rest)
                    found.append((body_start + n + 1, _without_comment(line[2:]).strip(), shown))
    return found


def _without_comment(line: str) -> str:
    """The line without a trailing `# comment` (a # inside quotes stays)."""
    quote = None
    for k, ch in enumerate(line):
        if quote is None and ch in "'\"":
            quote = ch
        elif ch == quote:
            quote = None
        elif ch == "#" and quote is None and (k == 0 or line[k - 1] == " "):
            return line[:k]
    return line


def shown_only(command: str) -> str | None:
    return next((why for pattern, why in SHOWN_ONLY if re.match(pattern, command)), None)


def matches(shown: list[str], printed: str) -> bool:
    """Whether the shown lines appear in order in what was printed (`...` as described above)."""
    out = [line.rstrip() for line in printed.splitlines()]
    k, skipping = 0, False  # the first shown line is the first printed one
    for want in (line.rstrip() for line in shown):
        if want == "...":
            skipping = True
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")) + "$")
        while k < len(out) and not pattern.match(out[k]):
            if not skipping:
                return False
            k += 1
        if k == len(out):
            return False
        k, skipping = k + 1, False
    return True


ALL = commands(README.read_text())
RUN = [(n, c, shown) for n, c, shown in ALL if shown_only(c) is None]


def test_the_readme_has_commands_of_both_kinds():
    assert len(RUN) >= 6 and len(ALL) - len(RUN) >= 8, [c for _, c, _ in ALL]
    for n, command, _ in ALL:  # a typo in a path would otherwise be "shown only" for ever
        assert command.startswith((".venv/bin/", "bash scripts/", "curl ", "sbatch ")), (n, command)
    # A command in a plain block without its `$ ` would be missed: there are none.
    loose = [line for language, _, body in blocks(README.read_text()) if language == ""
             for line in body if line.startswith((".venv/bin/", "bash ", "curl "))]
    assert not loose, loose


@pytest.mark.parametrize("line,command,shown", RUN, ids=[f"README:{n}" for n, _, _ in RUN])
def test_readme_command_runs_as_shown(line, command, shown):
    argv = command + (" --quick-compile" if QUICK.match(command) else "")
    run = subprocess.run(["bash", "-c", argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    printed = run.stdout + run.stderr
    error_shown = bool(shown) and any(s.startswith("jfire: error:") for s in shown)
    assert run.returncode == (2 if error_shown else 0), f"README line {line}: {command}\n{printed[-3000:]}"
    if shown:
        assert matches(shown, printed), f"README line {line}: {command} printed\n{printed[-3000:]}\nnot\n" + \
            "\n".join(shown)
    else:
        assert "Traceback" not in printed and "error" not in run.stderr.lower(), printed[-3000:]


def test_the_matcher_keeps_order_and_wildcards():
    printed = "a 1\nb 22\nc 3\nd\n"
    assert matches(["a 1", "...", "d"], printed) and matches(["a ...", "b ...2"], printed)
    assert not matches(["b 22", "a 1"], printed) and not matches(["a 1", "c 3"], printed)
    assert not matches(["a 1", "...", "e"], printed)
