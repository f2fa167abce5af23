"""The validation matrix: rows are checks, columns are targets, cells are verdicts.

A :class:`Cell` is one verdict (PASS / FAIL / SKIP) with its key figure (what the table
shows), a detail (why, for a FAIL or a SKIP) and the numbers behind the figure (what
``--baseline`` compares). A :class:`Matrix` holds them and round-trips through JSON, the
format a saved run (``validation.json``) and a baseline file share.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kunlun.errors import ConfigError, Location

FORMAT_VERSION = 1
"""Bumped when the JSON layout changes in a way old baselines cannot be read."""


class Status(enum.StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass
class Cell:
    """One check's verdict on one target."""

    status: Status
    figure: str = ""
    """The key figure shown in the table, e.g. ``3/3 correct`` or ``41 tok/s``."""
    detail: str = ""
    """Why it failed or was skipped, or what was measured (shown under the table)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The numbers behind the figure, compared by ``--baseline``."""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cell:
        return cls(
            Status(data["status"]),
            str(data.get("figure", "")),
            str(data.get("detail", "")),
            {k: float(v) for k, v in (data.get("metrics") or {}).items()},
        )


def passed(figure: str, detail: str = "", **metrics: float) -> Cell:
    return Cell(Status.PASS, figure, detail, dict(metrics))


def failed(figure: str, detail: str = "", **metrics: float) -> Cell:
    return Cell(Status.FAIL, figure, detail, dict(metrics))


def skipped(reason: str) -> Cell:
    return Cell(Status.SKIP, reason, reason)


@dataclass(frozen=True)
class Row:
    """One check as the matrix lists it."""

    id: str
    """Stable id, ``group.name`` (what baselines and JUnit use)."""
    title: str
    """Short human title for the table."""

    @property
    def group(self) -> str:
        return self.id.split(".", 1)[0]


@dataclass(frozen=True)
class Column:
    """One target as the matrix lists it."""

    name: str
    endpoint: str
    model: str
    pool: str | None = None
    reference: bool = False


@dataclass
class Matrix:
    """Every verdict of one run."""

    rows: list[Row]
    columns: list[Column]
    cells: dict[str, dict[str, Cell]] = field(default_factory=dict)
    """``cells[column][row_id]``."""
    meta: dict[str, Any] = field(default_factory=dict)
    """When it ran, how long it took, the settings (written to JSON as they are)."""

    def set(self, column: str, row_id: str, cell: Cell) -> None:
        self.cells.setdefault(column, {})[row_id] = cell

    def get(self, column: str, row_id: str) -> Cell | None:
        return self.cells.get(column, {}).get(row_id)

    def add_row(self, row: Row) -> None:
        if all(r.id != row.id for r in self.rows):
            self.rows.append(row)

    def failures(self) -> list[tuple[str, str, Cell]]:
        """``(column, row_id, cell)`` for every FAIL, in table order."""
        out = []
        for row in self.rows:
            for column in self.columns:
                cell = self.get(column.name, row.id)
                if cell is not None and cell.status is Status.FAIL:
                    out.append((column.name, row.id, cell))
        return out

    def counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in Status}
        for by_row in self.cells.values():
            for cell in by_row.values():
                counts[cell.status.value] += 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "meta": self.meta,
            "rows": [asdict(r) for r in self.rows],
            "columns": [asdict(c) for c in self.columns],
            "cells": {
                col: {row: cell.to_dict() for row, cell in by_row.items()}
                for col, by_row in self.cells.items()
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Matrix:
        return cls(
            [Row(**r) for r in data["rows"]],
            [Column(**c) for c in data["columns"]],
            {
                col: {row: Cell.from_dict(cell) for row, cell in by_row.items()}
                for col, by_row in data["cells"].items()
            },
            dict(data.get("meta") or {}),
        )


def load_matrix(path: Path) -> Matrix:
    """A saved run (``validation.json``), or a ConfigError naming the file and the problem."""
    where = Location(str(path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the baseline: {exc.strerror}", location=where) from None
    except ValueError as exc:
        raise ConfigError(f"the baseline is not JSON: {exc}", location=where) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(
            f"not a validation run of format {FORMAT_VERSION} (format: {found!r})",
            location=Location(str(path), field="format"),
            hint="use the validation.json that `kunlun-cli validate --out DIR` wrote",
        )
    try:
        return Matrix.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"the baseline is malformed: {type(exc).__name__}: {exc}", location=where
        ) from None
