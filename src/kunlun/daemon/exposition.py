"""The daemon's ``GET /metrics``: everything the platform measures, in one exposition.

On each scrape :meth:`PlatformTelemetry.render` concatenates:

1. the gateway's request metrics (:class:`~kunlun.telemetry.gateway_metrics.GatewayMetrics`);
2. the platform's state, read at scrape time: one ``kunlun_replica_info`` per replica (its
   model, priority, device and device type), readiness, queue depth and limit, restarts,
   start-up times from the worker's ready file, resident memory of the daemon and of each
   worker, and the latest :class:`~kunlun.telemetry.collector.DeviceSample` of every device;
3. every ready worker's own ``/metrics`` (fetched concurrently, 2 s limit each), each
   series relabelled with ``model``, ``replica``, ``priority`` and ``device``. A worker that
   does not answer is reported by ``kunlun_replica_scrape_up 0`` and its series are absent
   from that scrape.

Nothing here runs per request: a scrape costs one loopback request per worker. Reading the
workers' expositions and writing the whole one out runs in a thread, off the event loop that
relays every stream (milliseconds of CPU per replica).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import psutil
from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from kunlun.telemetry.collector import DeviceCollector, DeviceSample, interval_from_env
from kunlun.telemetry.gateway_metrics import GatewayMetrics
from kunlun.telemetry.view import PLATFORM_MEMORY

if TYPE_CHECKING:
    from kunlun.device.inventory import Inventory
    from kunlun.engine.launch import ReadyInfo
    from kunlun.node.agent import NodeAgent
    from kunlun.serving.replica import Replica, ReplicaSet

SCRAPE_TIMEOUT_S = 2.0
_MB = 1 << 20


@dataclass
class _Families:
    """A fixed list of metric families, in the shape ``generate_latest`` reads."""

    families: list[Metric]

    def collect(self) -> Iterable[Metric]:
        return self.families


class PlatformTelemetry:
    """The daemon's telemetry: device sampling and the merged ``/metrics``."""

    def __init__(
        self,
        replicas: ReplicaSet,
        agent: NodeAgent,
        gateway: GatewayMetrics,
        inventory: Callable[[], Inventory],
        interval_s: float | None = None,
    ) -> None:
        disable_created_metrics()
        self.replicas = replicas
        self.agent = agent
        self.gateway = gateway
        self.devices = DeviceCollector(inventory, interval_s or interval_from_env())
        self._http: httpx.AsyncClient | None = None
        self.sources: list[Callable[[], Iterable[Metric]]] = []
        """More families read at scrape time (e.g. the integrity checks')."""

    async def start(self) -> None:
        """Start device sampling (call from the app's lifespan)."""
        self._http = httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S)
        self.devices.start()

    async def close(self) -> None:
        await self.devices.stop()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.get("/metrics", include_in_schema=False)
        async def metrics() -> Response:
            return Response(await self.render(), media_type=CONTENT_TYPE_LATEST)

        return router

    async def render(self) -> bytes:
        """The whole exposition (see the module docstring)."""
        replicas = self.replicas.all()
        scraped = await asyncio.gather(*(self._scrape(r) for r in replicas))
        families = list(self._platform_families(replicas, scraped))  # live state: on the loop
        workers = [(_replica_labels(r), t) for r, t in zip(replicas, scraped, strict=True) if t]
        own = generate_latest(self.gateway.registry)  # its queue depth reads the admission
        # the workers' texts parsed, merged and written out: milliseconds per replica, in a
        # thread so that the streams this loop relays do not wait for a scrape
        return own + await asyncio.to_thread(_written, families, workers)

    async def _scrape(self, replica: Replica) -> str | None:
        if not (replica.ready and replica.base_url and self._http is not None):
            return None
        try:
            response = await self._http.get(replica.base_url + "/metrics",
                                            headers=replica.key_headers)  # fmt: skip
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    def _platform_families(
        self, replicas: list[Replica], scraped: list[str | None]
    ) -> Iterator[Metric]:
        yield from _replica_families(replicas, scraped, self.agent)
        yield from _memory_families(replicas)
        yield from _device_families(self.devices.latest().values())
        collector = self.devices
        yield CounterMetricFamily(
            "kunlun_device_samples", "Device samples taken by the collector.", collector.num_samples
        )
        yield CounterMetricFamily(
            "kunlun_device_sample_errors",
            "Device samples that failed (the previous sample is kept).",
            collector.num_errors,
        )
        for source in self.sources:
            yield from source()


def _replica_labels(replica: Replica) -> dict[str, str]:
    return {
        "model": replica.model,
        "replica": replica.replica_id,
        "priority": replica.priority,
        "device": replica.device,
    }


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _replica_families(
    replicas: list[Replica], scraped: list[str | None], agent: NodeAgent
) -> Iterator[Metric]:
    keys = ["model", "replica", "priority"]
    info = _gauge(
        "kunlun_replica_info",
        "One series per replica (value 1) naming its workload, device, device type and engine.",
        [*keys, "workload", "device", "device_type", "engine"],
    )
    ready = _gauge("kunlun_replica_ready", "1 when the replica takes requests.", keys)
    depth = _gauge(
        "kunlun_replica_queue_depth",
        "Requests admitted to the replica and not finished (the gateway answers 429 at the limit).",
        keys,
    )
    limit = _gauge("kunlun_replica_queue_limit", "The replica's max_queue.", keys)
    up = _gauge(
        "kunlun_replica_scrape_up", "1 when the worker's /metrics answered this scrape.", keys
    )
    restarts = CounterMetricFamily(
        "kunlun_replica_restarts",
        "Times the node agent restarted the replica's worker after it died.",
        labels=keys,
    )
    startup = _gauge(
        "kunlun_replica_startup_seconds",
        "Start-up of the replica's current "
        "worker, by phase: compile (model import), load, warmup_ttft, and total "
        "(process start to ready).",
        [*keys, "phase"],
    )
    for replica, text in zip(replicas, scraped, strict=True):
        values = [replica.model, replica.replica_id, replica.priority]
        device_type = replica.device.split(":", 1)[0]
        info.add_metric(
            [*values, replica.workload_id, replica.device, device_type, replica.engine], 1
        )
        ready.add_metric(values, 1 if replica.ready else 0)
        depth.add_metric(values, replica.in_flight)
        limit.add_metric(values, replica.max_queue)
        up.add_metric(values, 1 if text else 0)
        worker = agent.workers.get(replica.replica_id)
        if worker is None:
            continue
        restarts.add_metric(values, worker.restarts)
        for phase, value in _startup(worker.info, worker.started_at, worker.ready_at):
            startup.add_metric([*values, phase], value)
    yield from (info, ready, depth, limit, up, restarts, startup)


def _startup(
    info: ReadyInfo | None, started_at: float, ready_at: float | None
) -> Iterator[tuple[str, float]]:
    """(phase, seconds) from a worker's ready record and the agent's start and ready times."""
    if info is not None:
        ttft_s = None if info.warmup_ttft_ms is None else info.warmup_ttft_ms * 1e-3
        for phase, value in (("compile", info.compile_time_s), ("load", info.load_time_s),
                             ("warmup_ttft", ttft_s)):  # fmt: skip
            if value is not None:
                yield phase, value
    if ready_at is not None:
        yield "total", ready_at - started_at


def _memory_families(replicas: list[Replica]) -> Iterator[Metric]:
    """Resident memory of the daemon, of each worker, and of the daemon's process tree."""
    process = _gauge(
        "kunlun_process_resident_memory_bytes",
        'Resident memory of the daemon (replica "-") and of each replica\'s worker.',
        ["process", "replica"],
    )
    me = psutil.Process(os.getpid())
    tree = 0
    try:
        own = me.memory_info().rss
        process.add_metric(["daemon", "-"], own)
        tree = own + sum(_rss(child.pid) for child in me.children(recursive=True))
    except psutil.Error:
        pass
    for replica in replicas:
        rss = _rss(replica.pid) if replica.pid is not None else 0
        if rss:
            process.add_metric(["worker", replica.replica_id], rss)
    yield process
    yield GaugeMetricFamily(
        PLATFORM_MEMORY,
        "Resident memory of the daemon's whole process tree (daemon and every engine worker).",
        tree,
    )


def _rss(pid: int) -> int:
    """Resident memory of process ``pid``; 0 when it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


_DEVICE_GAUGES = (
    (
        "kunlun_device_utilization_percent",
        "utilization_pct",
        1.0,
        "Compute utilization as the vendor tool reports it (0 to 100).",
    ),
    ("kunlun_device_memory_used_bytes", "memory_used_mb", _MB, "Device memory in use."),
    ("kunlun_device_memory_total_bytes", "memory_total_mb", _MB, "Device memory in all."),
    ("kunlun_device_temperature_celsius", "temperature_c", 1.0, "Device temperature."),
    ("kunlun_device_power_watts", "power_w", 1.0, "Device power draw."),
    (
        "kunlun_device_memory_bandwidth_utilization_percent",
        "memory_bandwidth_util_pct",
        1.0,
        "Share of time device memory was read or written (0 to 100).",
    ),
    (
        "kunlun_device_memory_bandwidth_bytes_per_second",
        "memory_bandwidth_gbps",
        1e9,
        "Peak memory bandwidth as declared in device-plugin-config.yaml.",
    ),
)


def _device_families(samples: Iterable[DeviceSample]) -> Iterator[Metric]:
    samples = list(samples)
    keys = ["device_type", "device"]
    status = _gauge(
        "kunlun_device_status",
        "1 for the device's inventory status (Ready, Degraded, Unhealthy, Excluded).",
        [*keys, "status"],
    )
    age = _gauge(
        "kunlun_device_sample_timestamp_seconds",
        "When the device was last sampled (Unix time).",
        keys,
    )
    for sample in samples:
        status.add_metric([sample.device_type, sample.device_id, sample.status], 1)
        age.add_metric([sample.device_type, sample.device_id], sample.ts)
    yield status
    yield age
    for name, attribute, scale, doc in _DEVICE_GAUGES:
        family = _gauge(name, doc, keys)
        for sample in samples:
            value = getattr(sample, attribute)
            if value is not None:
                family.add_metric([sample.device_type, sample.device_id], value * scale)
        yield family


def _written(families: list[Metric], workers: list[tuple[dict[str, str], str]]) -> bytes:
    """``families`` and the workers' expositions relabelled, as exposition text."""
    return generate_latest(_Families(families + _relabelled(workers)))


def _relabelled(sources: Iterable[tuple[dict[str, str], str]]) -> list[Metric]:
    """Families of every worker's exposition, merged by name, each sample given its
    worker's labels."""
    merged: dict[str, Metric] = {}
    for labels, text in sources:
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue  # a worker answered something else than an exposition
        for family in families:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(
                    family.name, family.documentation, family.type
                )
            for sample in family.samples:
                target.add_sample(sample.name, {**labels, **sample.labels}, sample.value)
    return list(merged.values())
