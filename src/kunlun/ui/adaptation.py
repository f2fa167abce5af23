"""The Adaptation page: ``kunlun-cli adapt``'s verdicts, the known-good snapshots and the
acceptance reports, from the files of the daemon's home; and the route that serves those
report files.

Like the Validation and Bench pages (:mod:`kunlun.ui.reports`), the daemon keeps no record
of these runs: ``kunlun-cli adapt --out`` and ``kunlun-cli acceptance --out`` write files on
a client. The page shows what sits under ``KUNLUN_HOME`` of the daemon's machine:

- the newest ``adapt.json`` of each model, one or two folders under ``KUNLUN_HOME/reports``:
  its pool-by-gate verdict matrix (``adapt.json`` is plain JSON, written by
  :func:`kunlun.cli.adapt.report`), the stage seconds and the file it came from;
- the known-good snapshots of ``KUNLUN_HOME/snapshots`` as
  :func:`kunlun.validate.snapshots.listed` reads them, a file it cannot read said as an error;
- every ``acceptance-layerN.json`` one or two folders under ``KUNLUN_HOME/reports``
  (:func:`kunlun.validate.acceptance.write`): layer, title, verdict (and the checkpoints
  not run, which leave a layer unproven), whether it is signed (``.sig`` beside it), and a
  link to its HTML version.

``/ui/reports/PATH`` serves a report file (``.html``, ``.md``, ``.json``, ``.sig`` and
``.png`` screenshots) strictly from under ``KUNLUN_HOME/reports``: a path that resolves
outside it (``..``, a symbolic link pointing out) or any other suffix is 404. A report is a
static page: its Content-Security-Policy allows no script at all. Files of the daemon's
home: only an admin session sees any of this.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Route

from kunlun.ui.reports import ADMIN_ONLY, REPORTS, newest
from kunlun.ui.session import Session
from kunlun.validate import snapshots

if TYPE_CHECKING:
    from kunlun.ui.app import Dashboard

ADAPT = "adapt.json"
ACCEPTANCE = "acceptance-layer*.json"
SERVED = {
    ".html": "text/html; charset=utf-8",
    ".md": "text/plain; charset=utf-8",
    ".json": "application/json",
    ".sig": "text/plain; charset=utf-8",
    ".png": "image/png",
}
"""The suffixes ``/ui/reports/PATH`` serves, and their media types."""
FILE_HEADERS = {
    "content-security-policy": "default-src 'none'; img-src 'self' data:; style-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "cache-control": "no-store",
}
"""A report file's headers: no script, nothing from elsewhere, never framed."""
STATUS_CLASS = {"PASS": "pass", "FAIL": "fail", "NOT RUN": "skip"}


def routes(guarded: Callable[[Any], Any]) -> list[BaseRoute]:
    return [
        Route("/ui/adaptation", guarded(adaptation)),
        Route("/ui/reports/{path:path}", guarded(report_file)),
    ]


async def adaptation(ui: Dashboard, request: Request, session: Session) -> Response:
    view: dict[str, Any] = {"matrices": [], "snapshots": [], "unread": [], "acceptance": [],
                            "problems": []}  # fmt: skip
    if not session.admin:
        return ui.render("adaptation.html", session=session, error=ADMIN_ONLY,
                         page="adaptation", **view)  # fmt: skip
    problems: list[str] = view["problems"]
    view["matrices"] = latest_matrices(ui.home, problems)
    view["snapshots"] = [snapshot_row(s) for s in reversed(
        snapshots.listed(ui.home / snapshots.DIR_NAME, view["unread"]))]  # fmt: skip
    view["acceptance"] = acceptance_reports(ui.home, problems)
    return ui.render("adaptation.html", session=session, error=None, page="adaptation", **view)


def latest_matrices(home: Path, problems: list[str]) -> list[dict[str, Any]]:
    """The newest ``adapt.json`` of each model, newest first, as the page draws it; why each
    file that is not one goes to ``problems``."""
    seen: dict[str, dict[str, Any]] = {}
    for path in newest(home, ADAPT):
        try:
            matrix = adapt_matrix(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{path.relative_to(home)}: not an adapt.json of kunlun-cli adapt: "
                            f"{type(exc).__name__}: {exc}")  # fmt: skip
            continue
        if matrix["model"] not in seen:
            seen[matrix["model"]] = {**matrix, "file": str(path.relative_to(home)), "older": []}
        else:
            seen[matrix["model"]]["older"].append(str(path.relative_to(home)))
    return list(seen.values())


def adapt_matrix(doc: dict[str, Any]) -> dict[str, Any]:
    """``adapt.json`` as rows (one per pool and engine) of cells (one per gate, in the
    document's gate order); KeyError, TypeError or AttributeError when it is not one."""
    gates = [str(g) for g in doc["gates"]]
    rows = []
    for column in doc["columns"]:
        verdicts = column["verdicts"]
        cells = []
        for gate in gates:
            verdict = verdicts.get(gate) or {"status": "NOT RUN", "why": "not in the report"}
            status = str(verdict["status"])
            cells.append({"gate": gate, "status": status, "css": STATUS_CLASS.get(status, ""),
                          "figure": str(verdict.get("figure") or ""),
                          "why": str(verdict.get("why") or "")})  # fmt: skip
        rows.append({"column": str(column["column"]), "name": column.get("name"),
                     "tokens_per_s": column.get("tokens_per_s"), "cells": cells})  # fmt: skip
    seconds = {str(k): v for k, v in (doc.get("seconds") or {}).items() if k != "total"}
    if "total" in (doc.get("seconds") or {}):  # last, after the stages it adds up
        seconds["total"] = doc["seconds"]["total"]
    pools = [{"pool": str(p), "status": str(v["status"]), "engine": v.get("engine"),
              "why": str(v.get("why") or "")} for p, v in (doc.get("pools") or {}).items()]  # fmt: skip
    return {"model": str(doc["model"]), "gates": gates, "rows": rows, "seconds": seconds,
            "saved": [Path(str(s)).name for s in doc.get("snapshots") or []], "pools": pools}  # fmt: skip


def snapshot_row(snapshot: dict[str, Any]) -> dict[str, Any]:
    figures = snapshot.get("figures")
    figures = figures if isinstance(figures, dict) else {}
    return {**{k: snapshot.get(k) for k in ("id", "model", "pool", "engine", "created")},
            "accuracy": figures.get("accuracy"), "tokens_per_s": figures.get("tokens_per_s")}  # fmt: skip


def acceptance_reports(home: Path, problems: list[str]) -> list[dict[str, Any]]:
    """Every acceptance report under ``home/reports``, newest first; why each file that is
    not one goes to ``problems``."""
    found = []
    for path in newest(home, ACCEPTANCE):
        where = str(path.relative_to(home))
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            row = {k: doc[k] for k in ("layer", "title", "verdict", "created")}
            row["not_run"] = [str(n) for n in doc.get("not_run") or []]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{where}: not an acceptance report of kunlun-cli acceptance: "
                            f"{type(exc).__name__}: {exc}")  # fmt: skip
            continue
        page = path.with_suffix(".html")
        link = quote(str(page.relative_to(home / REPORTS))) if page.is_file() else None
        signed = path.with_name(path.name + ".sig").is_file()
        found.append({**row, "file": where, "signed": signed, "html": link})
    return found


async def report_file(ui: Dashboard, request: Request, session: Session) -> Response:
    """A file under ``KUNLUN_HOME/reports`` (see the module docstring), or 404."""
    if not session.admin:
        return Response(ADMIN_ONLY, 403, media_type="text/plain", headers=FILE_HEADERS)
    path = servable(ui.home / REPORTS, request.path_params["path"])
    if path is None:
        return Response("no such report file", 404, media_type="text/plain",
                        headers=FILE_HEADERS)  # fmt: skip
    return FileResponse(path, media_type=SERVED[path.suffix], headers=FILE_HEADERS)


def servable(root: Path, relative: str) -> Path | None:
    """``root/relative`` resolved (symbolic links followed), when it is a file of a served
    suffix inside ``root``; None otherwise."""
    if not relative or relative.startswith("/") or "\\" in relative:
        return None
    try:
        base = root.resolve(strict=True)
        path = (base / relative).resolve(strict=True)
    except (OSError, ValueError, RuntimeError):  # missing, a NUL byte, a symlink loop
        return None
    if not path.is_relative_to(base) or path.suffix not in SERVED or not path.is_file():
        return None
    return path
