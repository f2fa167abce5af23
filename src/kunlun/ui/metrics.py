"""The Metrics page: live charts drawn in the browser from the daemon's own ``/metrics``.

``/ui/metrics.json`` is one scrape of ``/metrics`` (as the session's key) read back by
:func:`kunlun.telemetry.view.parse`, the same reader ``kunlun-cli telemetry metrics`` uses:
per replica its generated tokens (a counter: the page turns deltas into tokens/s), queue
depth, KV cache use, and TTFT/TPOT p50/p99 estimated from the histograms since the replica
started. ``static/metrics.js`` polls it and draws SVG lines; no chart library.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kunlun.telemetry.view import parse
from kunlun.ui.app import ApiError
from kunlun.ui.session import Session

if TYPE_CHECKING:
    from kunlun.ui.app import Dashboard

FIGURES = ("model", "device", "generation_tokens", "queue_depth", "kv_cache_usage",
           "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")  # fmt: skip
"""What each replica's row carries to the page."""


async def metrics_page(ui: Dashboard, request: Request, session: Session) -> Response:
    return ui.render("metrics.html", session=session, page="metrics")


async def metrics_json(ui: Dashboard, request: Request, session: Session) -> Response:
    try:
        text = await ui.api(request, session, "GET", "/metrics")
    except ApiError as exc:
        return JSONResponse({"error": exc.message}, exc.status)
    replicas = {
        str(row["replica"]): {k: row.get(k) for k in FIGURES} for row in parse(text).replicas
    }
    return JSONResponse({"ts": time.time(), "replicas": replicas})
