"""The Validation and Bench pages: the newest reports in ``KUNLUN_HOME/reports``.

``kunlun-cli validate`` and ``kunlun-cli bench`` run on a client and write their results to
a folder (``--out``); the daemon keeps no record of either and has no API for them. The
pages show the newest ``validation.json`` and ``bench.json`` found one or two folders deep
under ``KUNLUN_HOME/reports`` of the daemon's machine (``kunlun-cli validate --out
~/.kunlun/reports/validation-DATE``), read by the same code that wrote them
(:func:`kunlun.validate.matrix.load_matrix`; ``bench.json`` is plain JSON). They are files of
the daemon's home, so only an admin session sees them.

The Bench page draws its charts on the server as inline SVG polylines (CSP-safe: no style
attributes, no script): output tokens/s, TTFT and TPOT p50/p99 against concurrency.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kunlun.errors import KunlunError
from kunlun.ui.session import Session
from kunlun.validate.matrix import load_matrix

if TYPE_CHECKING:
    from kunlun.ui.app import Dashboard

REPORTS = "reports"
"""The folder of ``KUNLUN_HOME`` the pages read."""
ADMIN_ONLY = "the reports are files of the daemon's home: an admin key sees them"
WIDTH, HEIGHT, PAD = 400, 160, 30


def routes(guarded: Callable[[Any], Any]) -> list[BaseRoute]:
    return [Route("/ui/validation", guarded(validation)), Route("/ui/bench", guarded(bench))]


def newest(home: Path, name: str) -> list[Path]:
    """Every ``name`` one or two folders under ``home/reports``, newest first."""
    root = home / REPORTS
    found = [*root.glob(f"*/{name}"), *root.glob(f"*/*/{name}")] if root.is_dir() else []
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


async def validation(ui: Dashboard, request: Request, session: Session) -> Response:
    error, matrix, files = None, None, []
    if not session.admin:
        error = ADMIN_ONLY
    else:
        files = newest(ui.home, "validation.json")
        try:
            matrix = load_matrix(files[0]) if files else None
        except KunlunError as exc:
            error = str(exc)
    return ui.render("validation.html", session=session, matrix=matrix, error=error,
                     files=[str(f.relative_to(ui.home)) for f in files], page="validation")  # fmt: skip


async def bench(ui: Dashboard, request: Request, session: Session) -> Response:
    error, doc, charts, files = None, None, [], []
    if not session.admin:
        error = ADMIN_ONLY
    else:
        files = newest(ui.home, "bench.json")
        try:
            doc = json.loads(files[0].read_text(encoding="utf-8")) if files else None
            charts = bench_charts(doc["runs"]) if doc else []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            error, doc = f"{files[0]}: not a bench.json of kunlun-cli bench: {exc}", None
    return ui.render("bench.html", session=session, doc=doc, charts=charts, error=error,
                     files=[str(f.relative_to(ui.home)) for f in files], page="bench")  # fmt: skip


def bench_charts(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Charts of the concurrency runs: title, top value, and series (name, SVG points)."""
    by_level = sorted((r for r in runs if r.get("mode") == "concurrency"),
                      key=lambda r: r["concurrency"])  # fmt: skip
    if not by_level:
        return []
    levels = [float(r["concurrency"]) for r in by_level]
    wanted = [
        ("Output tokens/s", {"tokens/s": [r.get("output_tokens_per_s") for r in by_level]}),
        *(
            (f"{what.upper()} (ms)", {
                q: [(r.get(f"{what}_ms") or {}).get(q) for r in by_level] for q in ("p50", "p99")
            })
            for what in ("ttft", "tpot")
        ),
    ]  # fmt: skip
    return [chart(title, levels, series) for title, series in wanted]


def chart(title: str, xs: list[float], series: dict[str, list[Any]]) -> dict[str, Any]:
    """One chart: each series' points scaled into the SVG box (x: log-ish spacing by rank)."""
    values = [float(v) for ys in series.values() for v in ys if v is not None]
    top = max(values, default=0.0) or 1.0
    step = (WIDTH - 2 * PAD) / max(1, len(xs) - 1)
    lines = []
    for name, ys in series.items():
        points = [(PAD + i * step, HEIGHT - 10 - (float(y) / top) * (HEIGHT - 25))
                  for i, y in enumerate(ys) if y is not None]  # fmt: skip
        lines.append({"name": name, "points": " ".join(f"{x:.1f},{y:.1f}" for x, y in points),
                      "dots": points})  # fmt: skip
    ticks = [(PAD + i * step, f"{x:g}") for i, x in enumerate(xs)]
    return {"title": title, "top": f"{top:.3g}", "lines": lines, "ticks": ticks}
