"""The Batches, Nodes and Rollouts pages: one daemon call each, drawn on the server.

- **Batches**: ``GET /v1/batches?limit=100`` (the OpenAI Batch API, as the session's key):
  each job's status and progress (completed and failed of total requests).
- **Nodes**: ``GET /api/v1/nodes`` on a cluster node; a single daemon answers that it is
  not part of a cluster, and the page then shows this node alone from its inventory
  (``GET /api/v1/devices``).
- **Scale** (a form on the Workloads page, admin keys): ``POST
  /api/v1/workloads/{id}/scale`` with the new replica count.
- **Rollouts**: ``GET /api/v1/rollouts``: each canary rollout's state, step and traffic
  weights.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from kunlun.errors import NotClustered
from kunlun.ui.app import ApiError
from kunlun.ui.session import Session

if TYPE_CHECKING:
    from kunlun.ui.app import Dashboard

BATCHES = 100
"""The newest batch jobs the page lists (the Batch API's largest page)."""
SINGLE_NODE = NotClustered.code
"""The daemon's refusal of a cluster route on a single node (its error code)."""


def routes(guarded: Callable[[Any], Any]) -> list[BaseRoute]:
    return [
        Route("/ui/batches", guarded(batches)),
        Route("/ui/nodes", guarded(nodes)),
        Route("/ui/rollouts", guarded(rollouts)),
        Route("/ui/workloads/{workload_id}/scale", guarded(scale), methods=["POST"]),
    ]


async def batches(ui: Dashboard, request: Request, session: Session) -> Response:
    error, rows = None, []
    try:
        rows = (await ui.api(request, session, "GET", f"/v1/batches?limit={BATCHES}"))["data"]
    except ApiError as exc:
        error = exc.message
    for row in rows:
        counts = row.get("request_counts") or {}
        row["done"] = counts.get("completed", 0) + counts.get("failed", 0)
    return ui.render("batches.html", session=session, batches=rows, error=error, page="batches")


async def nodes(ui: Dashboard, request: Request, session: Session) -> Response:
    error, rows, single = None, [], False
    try:
        try:
            rows = await ui.api(request, session, "GET", "/api/v1/nodes")
        except ApiError as exc:
            if exc.code != SINGLE_NODE:
                raise
            single = True
            devices = await ui.api(request, session, "GET", "/api/v1/devices")
            rows = [{"name": request.url.netloc, "state": "Ready", "leader": True,
                     "api_url": str(request.base_url).rstrip("/"),
                     "devices": [{"id": d["id"], "status": d["status"]} for d in devices],
                     "replicas": []}]  # fmt: skip
    except ApiError as exc:
        error = exc.message
    for row in rows:
        row["by_status"] = sorted(Counter(d.get("status") for d in row["devices"]).items())
    return ui.render("nodes.html", session=session, nodes=rows, single=single, error=error,
                     page="nodes")  # fmt: skip


async def rollouts(ui: Dashboard, request: Request, session: Session) -> Response:
    error, rows = None, []
    try:
        rows = await ui.api(request, session, "GET", "/api/v1/rollouts")
    except ApiError as exc:
        error = exc.message
    return ui.render("rollouts.html", session=session, rollouts=rows, error=error,
                     page="rollouts")  # fmt: skip


async def scale(ui: Dashboard, request: Request, session: Session) -> Response:
    from kunlun.ui.pages import workloads

    wid = request.path_params["workload_id"]
    form = {k: str(v) for k, v in (await request.form()).items()}
    value = form.get("replicas", "").strip()
    try:
        unknown = sorted(set(form) - {"replicas"})
        if unknown:
            raise ApiError(400, f"unknown field {unknown[0]!r}; the form takes 'replicas'",
                           unknown[0])  # fmt: skip
        if not value.isdigit():
            raise ApiError(400, f"replicas: must be a whole number, got {value!r}", "replicas")
        await ui.api(request, session, "POST", f"/api/v1/workloads/{wid}/scale",
                     {"replicas": int(value)})  # fmt: skip
    except ApiError as exc:
        return await workloads(ui, request, session, exc)
    return RedirectResponse("/ui/workloads", 303)
