"""The fault suite: marked `reliability` so `pytest -m reliability` runs it alone; its
summary line closes the run."""

from __future__ import annotations

import pathlib

import pytest

from tests.reliability.tally import TALLY

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)


def pytest_terminal_summary(terminalreporter):
    if TALLY.sent:
        terminalreporter.write_line(TALLY.line())
