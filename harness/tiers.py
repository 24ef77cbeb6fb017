"""The test tiers: each folder under tests/ marks every test it holds with its tier's marker, so that
``pytest -m unit`` (or ``processes``, ``engines``, ``serving``) runs one tier wherever it is started."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def marking_hook(conftest_file: str, marker: str) -> Callable[[list[pytest.Item]], None]:
    """A ``pytest_collection_modifyitems`` hook for the conftest at ``conftest_file``: pytest calls a
    conftest's collection hooks with every collected item, so it marks only those under its folder."""
    folder = Path(conftest_file).resolve().parent

    def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
        for item in items:
            if folder in item.path.resolve().parents:
                item.add_marker(getattr(pytest.mark, marker))

    return pytest_collection_modifyitems
