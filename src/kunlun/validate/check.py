"""What a check is and what it gets: the contract between the battery and its checks.

A :class:`Check` is a row of the matrix and a function from a :class:`Context` (one column's
client, the settings, the reference column's measurements) to a :class:`Cell`. A check
raises :class:`CheckFailed` when it cannot go on (the battery turns it into a FAIL cell);
it never decides about other rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kunlun.validate.client import TargetClient
from kunlun.validate.matrix import Cell, Column, Row


@dataclass(frozen=True)
class Settings:
    """How the battery runs (sized by default to finish in a few minutes on two CPU cores)."""

    work_dir: Path
    """Where checks write files (the batch runner's input and output)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer``; also what tells whether a 401 can be checked."""
    max_tokens: int = 24
    """Output budget of the functional checks' answers."""
    timeout_s: float = 180.0
    """Per request."""
    num_concurrent: int = 20
    """Requests sent at once by the concurrency check."""
    num_batch: int = 10
    """Lines in the batch runner's input file."""
    batch_size: int = 4
    """``--batch-size`` given to the batch runner."""
    perf_max_tokens: int = 32
    """Output tokens per request in the performance sweep."""
    perf_requests: tuple[tuple[int, int], ...] = ((1, 3), (4, 8))
    """``(concurrency, requests)`` of each performance row."""
    eval_file: Path | None = None
    """The multiple-choice evaluation set (None: the shipped one,
    :data:`kunlun.validate.accuracy.SHIPPED`)."""
    accuracy_points: float = 5.0
    """How many points of accuracy a column may score below the reference's."""
    seed: int = 0
    """Seeds the random numbers, questions and ids the checks draw (recorded with the run)."""


@dataclass
class Context:
    """One column's view while its checks run."""

    column: Column
    client: TargetClient
    settings: Settings
    rng: random.Random
    reference: dict[str, Any] | None = None
    """The reference column's ``scratch`` (None while the reference itself runs)."""
    scratch: dict[str, Any] = field(default_factory=dict)
    """Measurements this column's checks share (e.g. numerics probes)."""


@dataclass(frozen=True)
class Check:
    row: Row
    run: Callable[[Context], Cell]


def check(checks: list[Check], row_id: str, title: str) -> Callable[..., Any]:
    """Decorator adding a function to ``checks`` as the row ``row_id``."""

    def register(fn: Callable[[Context], Cell]) -> Callable[[Context], Cell]:
        checks.append(Check(Row(row_id, title), fn))
        return fn

    return register
