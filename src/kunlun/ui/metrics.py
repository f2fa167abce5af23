"""The Metrics page: live charts drawn in the browser from the daemon's own ``/metrics``.

``/ui/metrics.json?tab=ID`` is one scrape of ``/metrics`` (as the session's key): per
replica its model, device, queue depth and KV cache use (read by
:func:`kunlun.telemetry.view.parse`, the reader of ``kunlun-cli telemetry metrics``), and,
per replica, per device and per priority class, the figures of the window since the same
tab's previous poll (:mod:`kunlun.ui.windows`): TTFT/TPOT p50/p99 and tokens/s, queue wait
p50/p99, requests/s and waiting requests per class. ``static/metrics.js`` polls it and draws
SVG lines; no chart library.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kunlun.protocol.openai_errors import error_status_and_body, param_error
from kunlun.telemetry.view import parse
from kunlun.ui.app import ApiError
from kunlun.ui.session import COOKIE, Session
from kunlun.ui.windows import Windows, read, window

if TYPE_CHECKING:
    from kunlun.ui.app import Dashboard

FIGURES = ("model", "device", "queue_depth", "kv_cache_usage")
"""What each replica's row carries from the scrape itself (the window adds the rest)."""
TAB = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
WINDOWS = Windows()
"""Each browser tab's previous scrape (the daemon's one dashboard per process)."""


async def metrics_page(ui: Dashboard, request: Request, session: Session) -> Response:
    return ui.render("metrics.html", session=session, page="metrics")


async def metrics_json(ui: Dashboard, request: Request, session: Session) -> Response:
    unknown = sorted(set(request.query_params) - {"tab"})
    tab = request.query_params.get("tab", "")
    if unknown or not TAB.match(tab):
        field = unknown[0] if unknown else "tab"
        why = "unknown query field" if unknown else "tab: 1 to 64 of A-Z a-z 0-9 _ -"
        status, body, _ = error_status_and_body(param_error(field, f"{why} ({field})"))
        return JSONResponse(body, status)
    try:
        text = await ui.api(request, session, "GET", "/metrics")
    except ApiError as exc:
        return JSONResponse({"error": exc.message}, exc.status)
    now = read(text)
    sid = (request.cookies.get(COOKIE) or "").split(".", 1)[0]  # the session's own id
    before, span = WINDOWS.advance(f"{sid}:{tab}", now)
    windowed = window(now, before)
    replicas = {}
    for row in parse(text).replicas:
        rid = str(row["replica"])
        replicas[rid] = {k: row.get(k) for k in FIGURES} | windowed.get("replica", {}).get(rid, {})
    return JSONResponse({"ts": now.ts, "window_s": span, "replicas": replicas,
                         "devices": windowed.get("device", {}),
                         "priorities": windowed.get("priority", {})})  # fmt: skip
