"""The dashboard's pages: Devices, Workloads (list, one workload, submit, stop), Playground.

Each reads the daemon through :meth:`~kunlun.ui.app.Dashboard.api` (the admin API and
``/metrics``, as the session's key), so what a page shows is what ``kunlun-cli`` shows and
nothing is probed twice. A refused call (an ``inference`` key on an admin route) is shown as
the daemon's message, in place of the data. Templates autoescape every value.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, get_args

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from kunlun.engine.launch import Task
from kunlun.engine.schemes import SCHEMES
from kunlun.engines.registry import registered_names
from kunlun.planner.plan import ExecutionPlan
from kunlun.telemetry.view import parse
from kunlun.ui import adaptation, admin_pages, more_pages, reports
from kunlun.ui.app import ApiError, form_fields, same_origin
from kunlun.ui.metrics import metrics_json, metrics_page
from kunlun.ui.session import Session
from kunlun.ui.topology import CLASSES, matrices

if TYPE_CHECKING:
    from kunlun.ui.app import Dashboard

Page = Callable[["Dashboard", Request, Session], Awaitable[Response]]
SUBMIT_FIELDS = (
    "model",
    "name",
    "task",
    "device",
    "engine",
    "quantization",
    "max_num_seqs",
    "max_model_len",
    "kv_cache_memory_mb",
)
"""What the submit form takes; the whole numbers among them are :data:`WHOLE_FIELDS`."""
WHOLE_FIELDS = frozenset({"max_num_seqs", "max_model_len", "kv_cache_memory_mb"})
LOG_LINES = 40
"""The log lines a workload's page shows (its last ones)."""
PROBE_MARK = " health_probe"
"""How a worker's request line of a health probe ends (:meth:`kunlun.serving.worker_calls.Call.log_line`):
the page leaves those out of the tail unless asked (``?probes=1``); they would crowd it."""


def routes(dashboard: Dashboard) -> list[BaseRoute]:
    def guarded(page: Page) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            session = dashboard.session(request)
            if session is None:
                return RedirectResponse("/ui/login", 303)
            if request.method == "POST" and not same_origin(request):
                return Response("cross-site request refused", 403)
            return await page(dashboard, request, session)

        return endpoint

    return [
        Route("/ui/devices", guarded(devices)),
        Route("/ui/workloads", guarded(workloads), methods=["GET"]),
        Route("/ui/workloads", guarded(submit), methods=["POST"]),
        Route("/ui/workloads/{workload_id}", guarded(workload)),
        Route("/ui/workloads/{workload_id}/stop", guarded(stop), methods=["POST"]),
        Route("/ui/playground", guarded(playground)),
        Route("/ui/metrics", guarded(metrics_page)),
        Route("/ui/metrics.json", guarded(metrics_json)),
        *more_pages.routes(guarded),
        *admin_pages.routes(guarded),
        *reports.routes(guarded),
        *adaptation.routes(guarded),
    ]


async def devices(ui: Dashboard, request: Request, session: Session) -> Response:
    error, rows, inventory = None, [], []
    try:
        inventory = await ui.api(request, session, "GET", "/api/v1/devices")
        live = {
            _device_key(r): r
            for r in parse(await ui.api(request, session, "GET", "/metrics")).devices
        }
        for device in inventory:
            rows.append({**device, "live": live.get(device["id"], {})})
        rows += await other_nodes_devices(ui, request, session)
    except ApiError as exc:
        error = exc.message
    return ui.render("devices.html", session=session, devices=rows, error=error, page="devices",
                     matrices=matrices(inventory), link_classes=CLASSES)  # fmt: skip


async def other_nodes_devices(
    ui: Dashboard, request: Request, session: Session
) -> list[dict[str, Any]]:
    """On a cluster, every other node's devices as that node last published its inventory
    (ids as ``node/device``; no live figures: this node scrapes only its own workers); on a
    single node, none."""
    try:
        here = (await ui.api(request, session, "GET", "/api/v1/cluster"))["node"]
    except ApiError as exc:
        if exc.code == more_pages.SINGLE_NODE:
            return []
        raise
    rows = []
    for node in await ui.api(request, session, "GET", "/api/v1/nodes"):
        if node["name"] != here:
            rows += [{**d, "id": f"{node['name']}/{d.get('id')}", "live": {}}
                     for d in node.get("devices") or []]  # fmt: skip
    return rows


def _device_key(row: dict[str, Any]) -> str:
    device = str(row.get("device", ""))
    return device if ":" in device else f"{row.get('device_type')}:{device}"


async def workloads(
    ui: Dashboard,
    request: Request,
    session: Session,
    form_error: ApiError | None = None,
    form: dict[str, str] | None = None,
) -> Response:
    error, rows, choices = None, [], {}
    try:
        rows = await ui.api(request, session, "GET", "/api/v1/workloads")
        if session.admin:
            choices = await submit_choices(ui, request, session)
    except ApiError as exc:
        error = exc.message
    return ui.render("workloads.html", form_error.status if form_error else 200, session=session,
                     workloads=rows, error=error, form_error=form_error, form=form or {},
                     choices=choices, page="workloads")  # fmt: skip


async def submit_choices(ui: Dashboard, request: Request, session: Session) -> dict[str, Any]:
    """The submit form's pickers, from their owners: the daemon's models and devices, the
    engines its registry knows, the quantization schemes and the tasks of a workload."""
    models = await ui.api(request, session, "GET", "/api/v1/models")
    devices = await ui.api(request, session, "GET", "/api/v1/devices")
    return {
        "models": sorted(m["alias"] for m in models),
        "devices": [(d["id"], d.get("status", "")) for d in devices],
        "engines": list(registered_names()),
        "schemes": list(SCHEMES),
        "tasks": list(get_args(Task)),
    }


async def submit(ui: Dashboard, request: Request, session: Session) -> Response:
    form = {k: str(v) for k, v in (await request.form()).items()}
    try:
        spec = submit_spec(form)
        made = await ui.api(request, session, "POST", "/api/v1/workloads", spec)
    except ApiError as exc:
        return await workloads(ui, request, session, exc, form)
    return RedirectResponse(f"/ui/workloads/{made['workload_id']}", 303)


def submit_spec(form: dict[str, str]) -> dict[str, Any]:
    """The workload spec the submit form describes; :class:`ApiError` naming a bad field
    (the daemon's spec check names the rest)."""
    spec = form_fields(form, SUBMIT_FIELDS, WHOLE_FIELDS, least=1)
    if "model" not in spec:
        raise ApiError(400, "model: required (the alias of a registered model)", "model")
    return spec


async def workload(ui: Dashboard, request: Request, session: Session) -> Response:
    wid = request.path_params["workload_id"]
    probes = request.query_params.get("probes") == "1"
    error, info, lines, hidden = None, None, [], 0
    try:
        info = await ui.api(request, session, "GET", f"/api/v1/workloads/{wid}")
        logs = await ui.api(request, session, "GET", f"/api/v1/workloads/{wid}/logs")
        lines = logs["text"].splitlines()
        if not probes:
            kept = [line for line in lines if not line.endswith(PROBE_MARK)]
            hidden, lines = len(lines) - len(kept), kept
        lines = lines[-LOG_LINES:]
    except ApiError as exc:
        error = exc.message
    restarts = sum(r.get("restarts", 0) for r in (info or {}).get("replicas", []))
    plan = ((info or {}).get("placement") or {}).get("plan")
    return ui.render("workload.html", session=session, w=info, logs=lines, error=error,
                     restarts=restarts, page="workloads", hidden_probes=hidden, probes=probes,
                     plan_line=ExecutionPlan.from_dict(plan).summary() if plan else None)  # fmt: skip


async def stop(ui: Dashboard, request: Request, session: Session) -> Response:
    wid = request.path_params["workload_id"]
    try:
        await ui.api(request, session, "POST", f"/api/v1/workloads/{wid}/stop")
    except ApiError as exc:
        return await workloads(ui, request, session, exc)
    return RedirectResponse("/ui/workloads", 303)


async def playground(ui: Dashboard, request: Request, session: Session) -> Response:
    return ui.render("playground.html", session=session, page="playground")
