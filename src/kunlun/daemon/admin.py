"""The admin API under ``/api/v1``: devices, workloads, models, API keys.

What ``kunlun-cli`` calls when a daemon runs; once keys exist, only ``admin`` keys may
(:mod:`kunlun.daemon.auth`). GGUF imports read only under the model roots. Every error is a :class:`KunlunError`, turned
into JSON with its HTTP status by the app's one exception handler.
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Body, Query

from kunlun import catalog
from kunlun.errors import ConfigError, Location, NotClustered, RequestError
from kunlun.state.api_keys import (
    DEFAULT_SCOPE,
    check_networks,
    check_per_minute,
    create_key,
    describe_key,
    no_admin_warning,
    revoke_key,
)
from kunlun.workload.spec import parse_spec

if TYPE_CHECKING:
    from kunlun.cluster.node import ClusterNode
    from kunlun.daemon.app import Platform

MAX_LOG_CHUNK = 1 << 20
KEY_FIELDS = frozenset({"name", "priority", "scope", "rpm", "tpm", "allow_ips"})
"""What ``POST /apikeys`` takes (``allow_ips``: a list of CIDRs, or one comma-separated string)."""


def import_options(body: dict[str, Any]) -> dict[str, Any]:
    """The ``dtype`` and ``keep_quantized`` of ``POST /models/import-gguf`` (when given),
    type-checked; the daemon never draws a progress bar."""
    options: dict[str, Any] = {"progress": False}
    for field, kind in (("dtype", str), ("keep_quantized", bool)):
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, kind):
            raise RequestError(
                f"{field!r} must be a {kind.__name__}, got {value!r:.80}",
                location=Location("request", field=field),
            )
        options[field] = value
    return options


def admin_router(platform: Platform) -> APIRouter:
    """Every route of the admin API, one router per resource, in the order they are matched."""
    router = APIRouter()
    for routes in (_device_routes, _workload_routes, _model_routes, _key_routes, _cluster_routes):
        router.include_router(routes(platform))
    return router


def _device_routes(platform: Platform) -> APIRouter:
    """``GET /devices``: the inventory, discovered off the event loop."""
    router = APIRouter()

    @router.get("/devices")
    async def devices() -> list[dict[str, Any]]:
        inventory = await asyncio.to_thread(platform.inventory)
        return inventory.to_list()

    return router


def _workload_routes(platform: Platform) -> APIRouter:
    """``/workloads``: list, submit (or ``dry_run``), describe, read logs, stop."""
    router = APIRouter()
    manager = platform.manager

    @router.get("/workloads")
    def list_workloads() -> list[dict[str, Any]]:
        out = []
        for w in platform.store.list_workloads():
            ready = sum(
                1 for r in platform.replicas.all() if r.workload_id == w.workload_id and r.ready
            )
            out.append(
                {
                    "workload_id": w.workload_id,
                    "name": w.name,
                    "state": w.state,
                    "model": w.spec.get("model"),
                    "target_device": w.target_device,
                    "engine": (w.placement.get("engine") or {}).get("chosen"),
                    "replicas": w.spec.get("replicas", 1),
                    "ready_replicas": ready,
                    "priority": w.spec.get("priority"),
                    "reason": w.reason,
                    "created": w.created,
                }
            )
        return out

    @router.post("/workloads")
    async def submit(
        spec: dict[str, Any] = Body(...), dry_run: bool = Query(False)
    ) -> dict[str, Any]:
        parsed = parse_spec(spec, "request body")
        record = await asyncio.to_thread(manager.submit, parsed, dry_run)
        return {
            "workload_id": record.workload_id,
            "name": record.name,
            "state": record.state,
            "target_device": record.target_device,
            "placement": record.placement,
            "dry_run": dry_run,
        }

    @router.get("/workloads/{workload_id}")
    def describe(workload_id: str) -> dict[str, Any]:
        return manager.describe(workload_id)

    @router.get("/workloads/{workload_id}/logs")
    def logs(workload_id: str, offset: int = Query(0, ge=0)) -> dict[str, Any]:
        record = manager.get(workload_id)
        path = platform.agent.log_path(record.workload_id)
        if not path.exists():
            return {"text": "", "offset": 0, "state": record.state}
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if offset > size:  # past the end (a stale or made-up offset): resume from the end
                return {"text": "", "offset": size, "state": record.state}
            handle.seek(offset)
            data = handle.read(MAX_LOG_CHUNK)
        return {
            "text": data.decode("utf-8", errors="replace"),
            "offset": offset + len(data),
            "state": record.state,
        }

    @router.post("/workloads/{workload_id}/stop")
    async def stop(workload_id: str) -> dict[str, Any]:
        record = await asyncio.to_thread(manager.stop, workload_id)
        return {"workload_id": record.workload_id, "state": record.state}

    return router


def _model_routes(platform: Platform) -> APIRouter:
    """``/models``: list the catalog, import a GGUF file (or the demo), quantize a model."""
    router = APIRouter()

    @router.get("/models")
    def models() -> list[dict[str, Any]]:
        return [vars(m) for m in platform.store.list_models()]

    @router.post("/models/import-gguf")
    async def import_gguf(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        if body.get("demo"):
            record = await asyncio.to_thread(catalog.import_demo, platform.store)
        else:
            path = body.get("path")
            if not isinstance(path, str):
                raise ConfigError(
                    "'path' (a GGUF file on the daemon's machine) is required",
                    location=Location("path"),
                )
            roots = [
                *map(str, platform.model_roots),
                *platform.gateway.scheduler.config.model_roots,
            ]
            record = await asyncio.to_thread(
                functools.partial(catalog.import_gguf, **import_options(body)),
                platform.store,
                path,
                body.get("name"),
                roots,
            )
        return vars(record)

    @router.post("/models/quantize")
    async def quantize_model(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        model, scheme = body.get("model"), body.get("quantization")
        if not isinstance(model, str) or platform.store.get_model(model) is None:
            raise ConfigError(
                f"'model' must be the alias of a registered model, got {model!r}",
                location=Location("model"),
            )
        if not isinstance(scheme, str):
            raise ConfigError("'quantization' is required", location=Location("quantization"))
        record = await asyncio.to_thread(catalog.quantize_model, platform.store, model, scheme,
                                         body.get("group_size"), body.get("name"))  # fmt: skip
        return vars(record)

    return router


def _key_routes(platform: Platform) -> APIRouter:
    """``/apikeys``: list, create, revoke; the keyring is refreshed at once after a change."""
    router = APIRouter()

    @router.get("/apikeys")
    def list_keys() -> list[dict[str, Any]]:
        return [describe_key(k) for k in platform.store.list_api_keys()]

    @router.post("/apikeys")
    def new_key(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        unknown = sorted(set(body) - KEY_FIELDS)
        if unknown:
            raise RequestError(
                f"unknown field {unknown[0]!r}; a key takes {', '.join(sorted(KEY_FIELDS))}",
                location=Location("request", field=unknown[0]),
            )
        priority, scope = body.get("priority"), body.get("scope")
        record, secret = create_key(
            platform.store,
            str(body.get("name", "")),
            None if priority is None else str(priority),
            DEFAULT_SCOPE if scope is None else str(scope),
            rpm=check_per_minute(body.get("rpm"), "rpm"),
            tpm=check_per_minute(body.get("tpm"), "tpm"),
            allow_ips=check_networks(body.get("allow_ips"), "allow_ips"),
        )
        platform.keyring.refresh(force=True)
        return {**describe_key(record), "key": secret, "warning": no_admin_warning(platform.store)}

    @router.delete("/apikeys/{key}")
    def revoke(key: str) -> dict[str, Any]:
        record = revoke_key(platform.store, key)
        platform.keyring.refresh(force=True)
        return {"key_id": record.key_id, "name": record.name, "revoked": True}

    return router


def _cluster_routes(platform: Platform) -> APIRouter:
    """``/cluster`` and ``/nodes``: a cluster's status, its nodes, draining one; refused
    (:class:`NotClustered`) on a single node."""
    router = APIRouter()

    @router.get("/cluster")
    def cluster_status() -> dict[str, Any]:
        return _cluster(platform).status()

    @router.get("/nodes")
    def nodes() -> list[dict[str, Any]]:
        return _cluster(platform).nodes()

    @router.post("/nodes/{name}/drain")
    def drain(name: str) -> dict[str, Any]:
        return _cluster(platform).drain(name, True)

    @router.post("/nodes/{name}/undrain")
    def undrain(name: str) -> dict[str, Any]:
        return _cluster(platform).drain(name, False)

    return router


def _cluster(platform: Platform) -> ClusterNode:
    if platform.cluster is None:
        raise NotClustered(
            "this daemon is a single node, not part of a cluster",
            location=Location("kunlun-platform --cluster-etcd"),
            hint="start every node with --cluster-etcd URL --node-name NAME (docs/cluster.md)",
        )
    return platform.cluster
