"""The daemon's FastAPI application: health, the admin API, the gateway, API-key auth.

Routes:
- ``/healthz`` (liveness) and ``/readyz`` (200 once a replica has loaded and warmed up);
- ``/api/v1/...``: devices, workloads, models, API keys and endpoints (what ``kunlun-cli`` calls);
- ``/v1/...``: the OpenAI-compatible gateway (:mod:`kunlun.serving.gateway`) and the Batch
  API (:mod:`kunlun.daemon.batch_api`) and Request-as-a-Service endpoints
  (:mod:`kunlun.daemon.endpoints_api`); each finished ``/v1`` request is logged to
  ``KUNLUN_HOME/logs/requests.jsonl`` (:mod:`kunlun.daemon.request_log`).
- ``/metrics``: Prometheus exposition of devices, replicas and requests
  (:mod:`kunlun.daemon.exposition`).

Once any API key exists, every route but ``/healthz`` and ``/readyz`` needs one
(``Authorization: Bearer <key>``), ``/api/v1`` an ``admin`` one (:mod:`kunlun.daemon.auth`).
:func:`create_app` builds the FastAPI app (its routes);
:func:`create_asgi` is what the daemon serves: that app inside plain ASGI layers for the
request log, the key check and the gateway's inference endpoints (:func:`daemon_entry`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from kunlun import __version__
from kunlun import headers as http_headers
from kunlun.batch.files import FileStore
from kunlun.batch.jobs import MAX_RUNNING_JOBS, BatchJobs
from kunlun.daemon.admin import admin_router
from kunlun.daemon.auth import ApiKeyMiddleware
from kunlun.daemon.batch_api import batch_router, gateway_app, in_process_sender
from kunlun.daemon.body_check import JsonBodyCheck
from kunlun.daemon.endpoints_api import endpoints_admin_router, endpoints_router
from kunlun.daemon.exposition import PlatformTelemetry  # telemetry
from kunlun.daemon.measurements_api import measurements_router
from kunlun.daemon.request_log import RequestLog, RequestLogConfig, RequestLogMiddleware
from kunlun.daemon.rollout_api import rollout_router
from kunlun.daemon.scale_api import scale_router
from kunlun.device.inventory import Inventory, build_inventory
from kunlun.errors import KunlunError, Location, RequestError
from kunlun.node.agent import NodeAgent
from kunlun.node.health import HealthChecker, HealthConfig
from kunlun.node.liveness import LivenessConfig
from kunlun.offline.integrity import DEFAULT_INTERVAL_S, ModelGuard
from kunlun.protocol.openai_errors import http_error
from kunlun.rollout.controller import RolloutController
from kunlun.sandbox import SandboxPolicy
from kunlun.serving.gateway import GatewayEndpoints, error_response, gateway_router
from kunlun.serving.gateway_state import GatewayState
from kunlun.serving.key_limits import KeyLimiter
from kunlun.serving.replica import ReplicaSet
from kunlun.serving.response_state import ResponseState
from kunlun.serving.routing import DeviceLoad
from kunlun.serving.scheduler_config import FILE_NAME as SCHEDULER_CONFIG
from kunlun.serving.scheduler_config import SchedulerConfigSource
from kunlun.state.api_keys import KeyRing
from kunlun.state.sqlite import SQLiteStore
from kunlun.state.store import StateStore
from kunlun.workload.manager import WorkloadManager

if TYPE_CHECKING:  # a cluster's modules (etcd client, certificates) load only for a cluster
    from kunlun.cluster.member import ClusterConfig
    from kunlun.cluster.node import ClusterNode
    from kunlun.cluster.peer import PeerServer
    from kunlun.state.etcd import EtcdStore


@dataclass
class Platform:
    """Everything the daemon's routes share."""

    home: Path
    store: StateStore
    keyring: KeyRing
    replicas: ReplicaSet
    agent: NodeAgent
    manager: WorkloadManager
    gateway: GatewayState
    files: FileStore
    batches: BatchJobs
    request_log: RequestLog
    config: Path | None = None
    model_roots: tuple[Path, ...] = ()
    """Directories model imports may read from, besides the defaults and the config's."""
    integrity_interval_s: float = DEFAULT_INTERVAL_S
    """How often the served packages and the platform's files are re-hashed."""
    started_at: float = field(default_factory=time.time)
    cluster: ClusterNode | None = None
    """This node's part in a cluster (``--cluster-etcd``); None on a single node."""
    peer: PeerServer | None = None
    """The peer port other cluster nodes relay requests to."""
    rollouts: RolloutController | None = None
    """Canary rollouts (made by :func:`make_platform`)."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed to call the API (CORS); none: no CORS headers at all."""
    health: HealthChecker | None = None
    """Probes this node's replicas and ejects the failing ones from routing
    (:mod:`kunlun.node.health`)."""

    def inventory(self) -> Inventory:
        return build_inventory(config=self.config)


def make_platform(
    home: Path,
    config: Path | None = None,
    scheduler_config: Path | None = None,
    request_log_config: RequestLogConfig | None = None,
    batch_max_jobs: int = MAX_RUNNING_JOBS,
    model_roots: tuple[Path, ...] = (),
    sandbox: SandboxPolicy | None = None,
    liveness: LivenessConfig | None = None,
    upstream_timeouts_s: tuple[float | None, float | None] = (900.0, 300.0),
    guard: ModelGuard | None = None,
    integrity_interval_s: float = DEFAULT_INTERVAL_S,
    cluster: ClusterConfig | None = None,
    health: HealthConfig | None = None,
) -> Platform:
    """The daemon's parts. ``scheduler_config`` defaults to ``KUNLUN_HOME/scheduler_config.yaml``
    (absent: the defaults); a bad one raises :class:`~kunlun.errors.ConfigError`.
    ``batch_max_jobs``: Batch API jobs that send requests at once (the rest wait).
    ``model_roots``: where admin GGUF imports may read, besides the defaults and the config's;
    ``liveness``: how the node agent probes workers; ``upstream_timeouts_s``: the gateway's
    first-byte and read timeouts on workers' answers; ``guard``: which models may be served
    (default: any; :mod:`kunlun.offline.integrity`), re-checked every
    ``integrity_interval_s``. ``cluster``: join an etcd cluster (the state then lives in
    etcd, :mod:`kunlun.cluster`). ``health``: how replicas are health-checked (default:
    :class:`~kunlun.node.health.HealthConfig`'s defaults)."""
    scheduler = SchedulerConfigSource(scheduler_config or home / SCHEDULER_CONFIG)
    scheduler.load()
    store = state_store(home, cluster)
    replicas = ReplicaSet()
    holder: dict[str, WorkloadManager] = {}
    agent = NodeAgent(
        home, replicas, lambda wid, kind, msg: holder["m"].event(wid, kind, msg), sandbox, liveness
    )
    platform_config = config
    manager = WorkloadManager(
        store,
        agent,
        replicas,
        lambda: build_inventory(config=platform_config),
        guard or ModelGuard(home),
    )
    holder["m"] = manager
    first_byte_s, read_s = upstream_timeouts_s
    gateway = GatewayState(
        scheduler=scheduler, first_byte_timeout_s=first_byte_s, read_timeout_s=read_s
    )
    gateway.responses = ResponseState(store)  # previous_response_id, in the state store
    request_log = RequestLog(home / "logs" / "requests.jsonl", request_log_config)
    files_dir = cluster.files_dir if cluster is not None and cluster.files_dir else home / "files"
    files = FileStore(files_dir, store)
    if cluster is not None and cluster.tls is not None:
        gateway.upstream_ssl = cluster.tls.client_context()
    send = in_process_sender(RequestLogMiddleware(gateway_app(replicas, gateway), request_log))
    platform = Platform(
        home,
        store,
        KeyRing(store),
        replicas,
        agent,
        manager,
        gateway,
        files,
        BatchJobs(store, files, send, max_running_jobs=batch_max_jobs),
        request_log,
        config,
        model_roots,
        integrity_interval_s,
    )
    platform.health = HealthChecker(replicas, health or HealthConfig(), manager.event)
    platform.rollouts = RolloutController(store, manager, gateway, replicas)
    if cluster is not None:
        join_cluster(platform, cluster)
    return platform


def state_store(home: Path, cluster: ClusterConfig | None) -> StateStore:
    """The state: SQLite under ``home`` on a single node, the cluster's etcd in a cluster
    (its modules, the etcd client and certificates, load only then)."""
    if cluster is None:
        return SQLiteStore(home / "state.db")
    from kunlun.state.etcd import EtcdStore
    from kunlun.state.etcd_client import Etcd

    return EtcdStore(Etcd(cluster.endpoints, cluster.tls), cluster.prefix)


def join_cluster(platform: Platform, cluster: ClusterConfig) -> None:
    """``platform``'s part in ``cluster`` (:class:`~kunlun.cluster.node.ClusterNode`): the
    workload manager places through it, Batch API jobs and rollouts see every node."""
    from kunlun.cluster.batches import BatchOwners
    from kunlun.cluster.node import ClusterNode
    from kunlun.cluster.rollouts import rollout_hooks

    gateway = platform.gateway
    platform.cluster = node = ClusterNode(cluster, cast("EtcdStore", platform.store),
                                          platform.manager, platform.replicas,
                                          lambda: platform.inventory().to_list(),
                                          gateway.samples)  # fmt: skip
    platform.manager.cluster = node
    platform.batches.owners = node.batches = BatchOwners(node.member, node.view, platform.batches)
    if platform.rollouts is not None:
        platform.rollouts.cluster = rollout_hooks(node, gateway.rollout_stats)


def validation_error(exc: RequestValidationError) -> RequestError:
    """FastAPI's check of a route's parameters or body, as a 400 in the OpenAI error shape
    naming the first bad field and its value (FastAPI alone answers 422 in its own shape)."""
    errors = exc.errors() or [{"loc": ("body",), "msg": "invalid request"}]
    first = errors[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or "body"
    got = f" (got {first['input']!r})" if "input" in first else ""
    more = f"; {len(errors) - 1} more problem(s)" if len(errors) > 1 else ""
    return RequestError(
        f"{where}: {first.get('msg', 'invalid')}{got}{more}",
        location=Location("request", field=where),
    )


def feed_routing(gateway: GatewayState, samples: dict[str, Any]) -> None:
    """Give gateway routing the collector's utilization and temperature of each device."""
    for device_id, sample in samples.items():
        gateway.samples[device_id] = DeviceLoad(
            sample.utilization_pct, sample.temperature_c, sample.ts
        )


async def integrity_loop(platform: Platform) -> None:
    """Re-hash what is served at start and every ``integrity_interval_s``
    (:meth:`~kunlun.workload.manager.WorkloadManager.integrity_sweep`); a failed sweep is
    printed and the loop goes on."""
    while True:
        try:
            findings = await asyncio.to_thread(platform.manager.integrity_sweep)
            for finding in findings:
                if not finding.ok:
                    print(f"integrity check failed: {finding.describe()}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one bad sweep must not end the checks
            print(f"integrity sweep failed: {exc!r}", flush=True)
        await asyncio.sleep(platform.integrity_interval_s)


def create_app(platform: Platform) -> FastAPI:
    """The daemon's app over ``platform`` (started and stopped by the app's lifespan)."""
    telemetry = PlatformTelemetry(  # telemetry: /metrics and device samples (.devices.latest())
        platform.replicas, platform.agent, platform.gateway.metrics, platform.inventory
    )
    telemetry.devices.listeners.append(lambda samples: feed_routing(platform.gateway, samples))
    if platform.manager.guard is not None:
        telemetry.sources.append(platform.manager.guard.families)
    if platform.cluster is not None:
        telemetry.sources.append(platform.cluster.families)
    if platform.rollouts is not None:
        telemetry.sources.append(platform.rollouts.families)
    if platform.health is not None:
        telemetry.sources.append(platform.health.families)

    app = FastAPI(
        title="Kunlun Platform", version=__version__, lifespan=lifespan(platform, telemetry)
    )
    app.state.platform = platform
    app.state.telemetry = telemetry  # telemetry
    add_error_handlers(app)
    add_health_routes(app, platform)
    app.include_router(admin_router(platform), prefix="/api/v1")
    app.include_router(endpoints_admin_router(platform), prefix="/api/v1")
    app.include_router(measurements_router(platform), prefix="/api/v1")  # bench --record
    app.include_router(scale_router(platform), prefix="/api/v1")
    if platform.rollouts is not None:
        app.include_router(rollout_router(platform.rollouts), prefix="/api/v1")
    app.include_router(gateway_router(platform.replicas, platform.gateway))
    app.include_router(batch_router(platform.files, platform.batches))
    app.include_router(endpoints_router(platform))  # Request-as-a-Service endpoints
    app.include_router(telemetry.router())  # telemetry: GET /metrics (API key when keys exist)
    return app


def lifespan(
    platform: Platform, telemetry: PlatformTelemetry
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: start the gateway, telemetry, the node agent's supervisor, health
    checks, the peer port and cluster, resume the workloads, rollouts and batches; stop them
    all, in the reverse order, when the app stops."""

    @contextlib.asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        await platform.gateway.start()
        await telemetry.start()  # telemetry
        for line in platform.agent.sandbox.describe():
            print(line, flush=True)
        reaped = platform.agent.reap_leftovers()
        if reaped:
            print(
                f"reaped {len(reaped)} engine worker(s) left by an earlier daemon: {reaped}",
                flush=True,
            )
        supervisor = asyncio.create_task(platform.agent.supervise())
        health = None if platform.health is None else asyncio.create_task(platform.health.run())
        if platform.peer is not None:
            platform.peer.start()
        if platform.cluster is not None:
            if platform.cluster.batches is not None:
                platform.cluster.batches.loop = asyncio.get_running_loop()
            await asyncio.to_thread(platform.cluster.start)
        await asyncio.to_thread(platform.manager.resume_all)
        if platform.rollouts is not None:
            platform.rollouts.start()
        await platform.batches.start()
        integrity = asyncio.create_task(integrity_loop(platform))
        try:
            yield
        finally:
            integrity.cancel()
            if platform.rollouts is not None:
                await asyncio.to_thread(platform.rollouts.stop)
            await platform.batches.close()
            supervisor.cancel()
            if health is not None:
                health.cancel()
            if platform.cluster is not None:
                await asyncio.to_thread(platform.cluster.stop)
            if platform.peer is not None:
                await asyncio.to_thread(platform.peer.stop)
            await telemetry.close()  # telemetry
            await asyncio.to_thread(platform.agent.stop_all)
            await platform.gateway.close()
            platform.request_log.close()
            platform.store.close()

    return run


def add_error_handlers(app: FastAPI) -> None:
    """Every error in the OpenAI shape: a :class:`KunlunError`, an HTTP error of the
    framework's own (404, 405) and a route's parameters or body that do not check (400)."""

    @app.exception_handler(KunlunError)
    async def kunlun_error(request: Request, exc: KunlunError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error_shape(request: Request, exc: StarletteHTTPException) -> Response:
        error = http_error(exc.status_code, request.method, request.url.path, str(exc.detail))
        response = error_response(error)
        for name, value in (exc.headers or {}).items():  # e.g. Allow on a 405
            response.headers[name] = value
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(exc))


def add_health_routes(app: FastAPI, platform: Platform) -> None:
    """``/healthz`` (the daemon runs) and ``/readyz`` (a replica has loaded and warmed up)."""

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "version": __version__,
            "uptime_s": round(time.time() - platform.started_at, 1),
        }

    @app.get("/readyz")
    async def readyz() -> Response:
        if platform.gateway.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if platform.replicas.any_ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "no replica has loaded and warmed up yet"}, status_code=503)


def create_asgi(platform: Platform) -> ASGIApp:
    """What the daemon serves: :func:`create_app` inside :func:`daemon_entry`, with the
    dashboard (:mod:`kunlun.ui`, its own session check) in front at ``/ui``."""
    from kunlun.ui import Dashboard, MetricsHistory

    app = create_app(platform)
    entry = daemon_entry(
        app,
        platform.replicas,
        platform.gateway,
        platform.keyring,
        platform.request_log,
        platform.allowed_origins,
    )
    history = MetricsHistory(app.state.telemetry.render)
    return Dashboard(entry, platform.keyring, platform.home, history)


def daemon_entry(
    app: ASGIApp,
    replicas: ReplicaSet,
    gateway: GatewayState,
    keyring: KeyRing,
    request_log: RequestLog,
    allowed_origins: tuple[str, ...] = (),
) -> ASGIApp:
    """The daemon's ASGI entry around ``app``: the request log (outermost, so 401s are
    logged too), then the API-key check (:mod:`kunlun.daemon.auth`: scopes and per-key
    limits, the defaults from ``gateway``'s scheduler config), then the gateway's inference
    endpoints (:class:`~kunlun.serving.gateway.GatewayEndpoints`), then, for every other
    route, the JSON body check (:class:`~kunlun.daemon.body_check.JsonBodyCheck`) and ``app``.

    They wrap the FastAPI app from outside, plain ASGI, so an inference request meets no
    framework layer at all: measured with ``benchmarks/gateway.py``, FastAPI's own entry
    and middleware cost about 0.2 ms of the time to first token per request.

    With ``allowed_origins`` (``--allowed-origins``), CORS sits between the log and the key
    check: a browser's preflight (``OPTIONS``, which carries no key) is answered there, and
    answers to those origins carry the CORS headers. Without, there is no CORS at all."""
    endpoints = GatewayEndpoints(JsonBodyCheck(app), replicas, gateway)
    limiter = KeyLimiter(lambda: gateway.scheduler.config.api_keys, gateway.metrics.registry)
    inner: ASGIApp = ApiKeyMiddleware(endpoints, keyring, limiter)
    if allowed_origins:
        inner = CORSMiddleware(
            inner,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "X-API-Key", http_headers.REQUEST_ID,
                           http_headers.PRIORITY, http_headers.POOL, http_headers.SESSION],
            expose_headers=[http_headers.REQUEST_ID, http_headers.DEVICE, http_headers.VERSION,
                            "Retry-After"],
        )  # fmt: skip
    return RequestLogMiddleware(inner, request_log)
