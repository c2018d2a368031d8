"""The fault suite is marked `reliability`, so `pytest -m reliability` runs it alone. Its
summary line is printed by tests/conftest.py, which also adds up the counts of parallel
workers."""

from __future__ import annotations

import pathlib

import pytest

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)
