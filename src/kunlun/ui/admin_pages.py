"""The Models and Keys pages (admin keys; an ``inference`` key sees the daemon's refusal).

- **Models** (``/ui/models``): the catalog (``GET /api/v1/models``): each alias, where it
  came from, its form (the quantization scheme it was written in, or its checkpoint's
  dtype), its size on disk, and the other forms of the same model (aliases quantized from
  it, or from the model it was quantized from).
- **One model** (``/ui/models/{alias}``): the same facts, and its plan on each pool of this
  node: a dry run (``POST /api/v1/workloads?dry_run=true``) on the first ready device of
  each device type, showing the plan's line and its figures, or the planner's refusal.
- **Keys** (``/ui/keys``): the daemon's API keys (never their hashes), a form that creates
  one (``POST /api/v1/apikeys``; the secret is shown once, on the page that answers the
  form) and a revoke button per active key (``DELETE /api/v1/apikeys/{id}``).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from kunlun.limits import PRIORITIES
from kunlun.planner.plan import ExecutionPlan
from kunlun.state.api_keys import DEFAULT_SCOPE, SCOPES
from kunlun.ui.app import ApiError, form_fields
from kunlun.ui.session import Session

if TYPE_CHECKING:
    from kunlun.ui.app import Dashboard

KEY_FORM = ("name", "scope", "priority", "rpm", "tpm", "allow_ips")
"""What the create-key form takes (``POST /api/v1/apikeys`` takes the same)."""
WHOLE = frozenset({"rpm", "tpm"})
QUANTIZED_FROM = "quantized:"
"""How a quantized alias's ``source`` names the alias it was made from."""


def routes(guarded: Callable[[Any], Any]) -> list[BaseRoute]:
    return [
        Route("/ui/models", guarded(models)),
        Route("/ui/models/{alias}", guarded(model)),
        Route("/ui/keys", guarded(keys), methods=["GET"]),
        Route("/ui/keys", guarded(create_key), methods=["POST"]),
        Route("/ui/keys/{key_id}/revoke", guarded(revoke_key), methods=["POST"]),
    ]


def origin(record: dict[str, Any]) -> str:
    """The alias a model's forms are grouped under: what it was quantized from, or itself."""
    source = str(record.get("source", ""))
    return source[len(QUANTIZED_FROM) :] if source.startswith(QUANTIZED_FROM) else record["alias"]


def on_disk(path: str) -> dict[str, Any]:
    """Size on disk (MiB) of a model's directory and the form its config names; runs in a
    thread (a directory walk)."""
    root = Path(path)
    if not root.is_dir():
        return {"size_mb": None, "dtype": None, "missing": True}
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += (Path(folder) / name).stat().st_size
            except OSError:
                continue
    dtype = None
    config = root / "config.json"
    if config.is_file() and config.stat().st_size < (1 << 20):
        try:
            dtype = json.loads(config.read_text()).get("torch_dtype")
        except (ValueError, UnicodeDecodeError):
            dtype = None
    return {"size_mb": round(total / (1 << 20), 1), "dtype": dtype, "missing": False}


async def catalog(ui: Dashboard, request: Request, session: Session) -> list[dict[str, Any]]:
    """The catalog's rows with form, size and sibling forms added."""
    records = await ui.api(request, session, "GET", "/api/v1/models")
    disk = await asyncio.gather(*(asyncio.to_thread(on_disk, r["path"]) for r in records))
    groups: dict[str, list[str]] = {}
    for r in records:
        groups.setdefault(origin(r), []).append(r["alias"])
    rows = []
    for r, facts in zip(records, disk, strict=True):
        meta = r.get("meta") or {}
        form = meta.get("quantization") or facts["dtype"] or "–"
        forms = sorted(a for a in groups[origin(r)] if a != r["alias"])
        rows.append({**r, **facts, "form": form, "forms": forms})
    return sorted(rows, key=lambda row: (origin(row), row["alias"]))


async def models(ui: Dashboard, request: Request, session: Session) -> Response:
    error, rows = None, []
    try:
        rows = await catalog(ui, request, session)
    except ApiError as exc:
        error = exc.message
    return ui.render("models.html", session=session, models=rows, error=error, page="models")


async def model(ui: Dashboard, request: Request, session: Session) -> Response:
    alias = request.path_params["alias"]
    error, found, plans = None, None, []
    try:
        found = next((r for r in await catalog(ui, request, session) if r["alias"] == alias), None)
        if found is None:
            error = f"no model {alias!r} in the catalog"
        else:
            plans = await pool_plans(ui, request, session, alias)
    except ApiError as exc:
        error = exc.message
    return ui.render("model.html", 404 if found is None and error else 200, session=session,
                     m=found, plans=plans, error=error, page="models")  # fmt: skip


async def pool_plans(
    ui: Dashboard, request: Request, session: Session, alias: str
) -> list[dict[str, Any]]:
    """Per device type of this node: the plan of ``alias`` on its first ready device (a dry
    run, nothing started), or why it cannot run there."""
    devices = await ui.api(request, session, "GET", "/api/v1/devices")
    pools: dict[str, list[dict[str, Any]]] = {}
    for d in devices:
        pools.setdefault(d["type"], []).append(d)
    out = []
    for pool, members in sorted(pools.items()):
        ready = [d for d in members if d.get("status") == "Ready"]
        row: dict[str, Any] = {"pool": pool, "devices": len(members), "device": None,
                               "plan": None, "line": None, "refused": None}  # fmt: skip
        if not ready:
            row["refused"] = f"no device of type {pool} is Ready"
            out.append(row)
            continue
        row["device"] = ready[0]["id"]
        try:
            made = await ui.api(request, session, "POST", "/api/v1/workloads?dry_run=true",
                                {"model": alias, "device": ready[0]["id"]})  # fmt: skip
        except ApiError as exc:
            row["refused"] = exc.message
        else:
            plan = (made.get("placement") or {}).get("plan")
            if plan:
                row["plan"] = plan
                row["line"] = ExecutionPlan.from_dict(plan).summary()
            else:
                row["refused"] = (made.get("placement") or {}).get("why") or "no plan"
        out.append(row)
    return out


async def keys(
    ui: Dashboard,
    request: Request,
    session: Session,
    made: dict[str, Any] | None = None,
    form_error: ApiError | None = None,
    form: dict[str, str] | None = None,
) -> Response:
    error, rows = None, []
    try:
        rows = await ui.api(request, session, "GET", "/api/v1/apikeys")
    except ApiError as exc:
        error = exc.message
    return ui.render("keys.html", form_error.status if form_error else 200, session=session,
                     keys=rows, error=error, made=made, form_error=form_error, form=form or {},
                     scopes=SCOPES, default_scope=DEFAULT_SCOPE, priorities=PRIORITIES,
                     page="keys")  # fmt: skip


def key_body(form: dict[str, str]) -> dict[str, Any]:
    """The ``POST /api/v1/apikeys`` body of the create form; :class:`ApiError` naming a bad
    field (the daemon checks the rest: scope, priority, networks). A limit of 0 is none."""
    return form_fields(form, KEY_FORM, WHOLE, least=0)


async def create_key(ui: Dashboard, request: Request, session: Session) -> Response:
    form = {k: str(v) for k, v in (await request.form()).items()}
    try:
        made = await ui.api(request, session, "POST", "/api/v1/apikeys", key_body(form))
    except ApiError as exc:
        return await keys(ui, request, session, form_error=exc, form=form)
    return await keys(ui, request, session, made=made)


async def revoke_key(ui: Dashboard, request: Request, session: Session) -> Response:
    key_id = request.path_params["key_id"]
    try:
        await ui.api(request, session, "DELETE", f"/api/v1/apikeys/{key_id}")
    except ApiError as exc:
        return await keys(ui, request, session, form_error=exc)
    return RedirectResponse("/ui/keys", 303)
