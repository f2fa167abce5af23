"""The Metrics page: charts drawn in the browser from the daemon's sampled history.

``/ui/metrics.json`` answers the points of :class:`~kunlun.ui.history.MetricsHistory` (the
daemon's own ``/metrics``, sampled every few seconds and kept for 15 minutes): all of them,
or with ``?after=TS`` those sampled after the last point the page has. Each point carries,
per replica, its model, device, queue depth and KV cache use, and per replica, per device
and per priority class the figures of the window since the sample before
(:mod:`kunlun.ui.windows`): TTFT/TPOT p50/p99 and tokens/s, queue wait p50/p99,
requests/s and waiting requests per class. ``static/metrics.js`` draws SVG lines on a time
axis; no chart library. Any session may read it: ``/metrics`` is open to both key scopes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kunlun.protocol.openai_errors import error_status_and_body, param_error
from kunlun.ui.session import Session

if TYPE_CHECKING:
    from kunlun.ui.app import Dashboard


async def metrics_page(ui: Dashboard, request: Request, session: Session) -> Response:
    return ui.render("metrics.html", session=session, page="metrics",
                     interval_s=ui.history.interval_s, keep_min=round(ui.history.keep_s / 60))  # fmt: skip


async def metrics_json(ui: Dashboard, request: Request, session: Session) -> Response:
    unknown = sorted(set(request.query_params) - {"after"})
    raw = request.query_params.get("after")
    after = None
    if raw is not None:
        try:
            after = float(raw)
        except ValueError:
            after = math.nan
    if unknown or (after is not None and not math.isfinite(after)):
        field = unknown[0] if unknown else "after"
        why = "unknown query field" if unknown else f"a Unix time in seconds, got {raw!r:.40}"
        status, body, _ = error_status_and_body(param_error(field, f"{field}: {why}"))
        return JSONResponse(body, status)
    history = ui.history
    return JSONResponse({"interval_s": history.interval_s, "keep_s": history.keep_s,
                         "points": history.after(after)})  # fmt: skip
