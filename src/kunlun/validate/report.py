"""The matrix as Markdown, HTML, JSON, JUnit XML and a rich table.

Every format shows the same thing: one row per check, one column per target, each cell
``PASS`` / ``FAIL`` / ``SKIP`` with its key figure; below the table (or in the JUnit
failure message) the detail of every FAIL and SKIP.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from xml.etree import ElementTree as ET

from rich.markup import escape
from rich.table import Table

from kunlun.validate.matrix import Cell, Matrix, Status

FILES = {
    "markdown": "validation.md",
    "html": "validation.html",
    "json": "validation.json",
    "junit": "validation.junit.xml",
}
_RICH_STYLE = {Status.PASS: "green", Status.FAIL: "bold red", Status.SKIP: "yellow"}
_HTML_COLOR = {Status.PASS: "#d7f5dd", Status.FAIL: "#f9d0d0", Status.SKIP: "#f5f0c8"}


def _header(matrix: Matrix) -> list[str]:
    return [c.name + (" (reference)" if c.reference else "") for c in matrix.columns]


def _cell_text(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    return f"{cell.status.value} {cell.figure}".strip()


def _notes(matrix: Matrix) -> list[tuple[str, str, Cell]]:
    """``(column, row_id, cell)`` of every FAIL and SKIP, for the lines under a table."""
    out = []
    for row in matrix.rows:
        for column in matrix.columns:
            cell = matrix.get(column.name, row.id)
            if cell is not None and cell.status is not Status.PASS and cell.detail:
                out.append((column.name, row.id, cell))
    return out


def _summary(matrix: Matrix) -> str:
    counts = matrix.counts()
    parts = [f"{counts[s.value]} {s.value}" for s in Status]
    return f"{', '.join(parts)} in {matrix.meta.get('duration_s', '?')} s"


def to_markdown(matrix: Matrix) -> str:
    def esc(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    targets = ", ".join(
        f"`{c.name}` = {c.endpoint} model `{c.model}`" + (f" pool `{c.pool}`" if c.pool else "")
        for c in matrix.columns
    )
    lines = [
        f"Targets: {targets}. {_summary(matrix)}.",
        "",
        "| check | " + " | ".join(esc(h) for h in _header(matrix)) + " |",
        "|---|" + "---|" * len(matrix.columns),
    ]
    for row in matrix.rows:
        cells = [esc(_cell_text(matrix.get(c.name, row.id))) for c in matrix.columns]
        lines.append(f"| {esc(row.title)} | " + " | ".join(cells) + " |")
    notes = _notes(matrix)
    if notes:
        lines.append("")
        for column, row_id, cell in notes:
            lines.append(f"- **{cell.status.value}** `{row_id}` on `{column}`: {esc(cell.detail)}")
    return "\n".join(lines) + "\n"


def to_html(matrix: Matrix) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in _header(matrix))
    body = []
    for row in matrix.rows:
        tds = []
        for column in matrix.columns:
            cell = matrix.get(column.name, row.id)
            color = _HTML_COLOR[cell.status] if cell else "#ffffff"
            tip = e(cell.detail) if cell else ""
            tds.append(f'<td style="background:{color}" title="{tip}">{e(_cell_text(cell))}</td>')
        body.append(f'<tr><th title="{e(row.id)}">{e(row.title)}</th>{"".join(tds)}</tr>')
    notes = "".join(
        f"<li><b>{cell.status.value}</b> <code>{e(row_id)}</code> on <code>{e(column)}</code>: "
        f"{e(cell.detail)}</li>"
        for column, row_id, cell in _notes(matrix)
    )
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8"><title>Kunlun validation</title>'
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
        "td,th{border:1px solid #999;padding:4px 8px;text-align:left}</style></head><body>\n"
        f"<h1>Kunlun validation</h1><p>{e(_summary(matrix))}</p>\n"
        f"<table><tr><th>check</th>{head}</tr>\n" + "\n".join(body) + "</table>\n"
        f"<ul>{notes}</ul>\n</body></html>\n"
    )


def to_junit(matrix: Matrix) -> str:
    """One ``<testsuite>`` per column, one ``<testcase>`` per check."""
    suites = ET.Element("testsuites", name="kunlun-validate")
    for column in matrix.columns:
        cells = matrix.cells.get(column.name, {})
        suite = ET.SubElement(
            suites,
            "testsuite",
            name=column.name,
            tests=str(len(cells)),
            failures=str(sum(c.status is Status.FAIL for c in cells.values())),
            skipped=str(sum(c.status is Status.SKIP for c in cells.values())),
        )
        for row in matrix.rows:
            cell = cells.get(row.id)
            if cell is None:
                continue
            case = ET.SubElement(
                suite,
                "testcase",
                classname=f"{column.name}.{row.group}",
                name=row.id,
                time=str(cell.metrics.get("seconds", 0.0)),
            )
            if cell.status is Status.FAIL:
                ET.SubElement(case, "failure", message=cell.figure).text = cell.detail
            elif cell.status is Status.SKIP:
                ET.SubElement(case, "skipped", message=cell.detail or cell.figure)
            else:
                ET.SubElement(case, "system-out").text = cell.figure
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, "unicode") + "\n"


def to_json(matrix: Matrix) -> str:
    return json.dumps(matrix.to_dict(), indent=2, ensure_ascii=False) + "\n"


def write_all(matrix: Matrix, out_dir: Path) -> dict[str, Path]:
    """Every format under ``out_dir``; returns the paths by format."""
    out_dir.mkdir(parents=True, exist_ok=True)
    writers = {"markdown": to_markdown, "html": to_html, "json": to_json, "junit": to_junit}
    paths = {}
    for kind, writer in writers.items():
        path = out_dir / FILES[kind]
        path.write_text(writer(matrix), encoding="utf-8")
        paths[kind] = path
    return paths


def rich_table(matrix: Matrix) -> Table:
    table = Table(title=f"Validation: {_summary(matrix)}", title_justify="left")
    table.add_column("check")
    for header in _header(matrix):
        table.add_column(header)
    for row in matrix.rows:
        cells = []
        for column in matrix.columns:
            cell = matrix.get(column.name, row.id)
            text = escape(_cell_text(cell))
            cells.append(f"[{_RICH_STYLE[cell.status]}]{text}[/]" if cell else "-")
        table.add_row(row.title, *cells)
    return table


def notes_lines(matrix: Matrix) -> list[str]:
    """The detail of every FAIL and SKIP, one line each (printed under the rich table)."""
    return [f"{cell.status.value} {row_id} on {column}: {cell.detail}"
            for column, row_id, cell in _notes(matrix)]  # fmt: skip
