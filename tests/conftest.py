"""Suite-wide test order: the slowest files first.

``make test`` runs the suite on two workers (pytest-xdist, one file per worker at a time).
Starting the longest files first keeps the two busy to the end instead of leaving one
running the validation battery alone.
"""

from __future__ import annotations

import pytest

FIRST = (
    "tests/rollout/test_twenty_canaries.py",
    "tests/validate/test_validate.py",
    "tests/engine/test_llm_engine.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return FIRST.index(path) if path in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: the collection order within each rank
