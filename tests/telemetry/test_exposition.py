"""The daemon's exposition without a daemon: recorded devices, gateway counters, a replica
whose worker does not answer, read back through the view the CLI uses."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.telemetry.conftest import mixed_inventory

from kunlun.daemon.exposition import PlatformTelemetry
from kunlun.node.agent import NodeAgent
from kunlun.protocol.openai_errors import ModelNotFound, QueueFull
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.telemetry.gateway_metrics import GatewayMetrics
from kunlun.telemetry.view import histogram_quantile, parse, parse_filters


def render(home: Path, replicas: ReplicaSet, gateway: GatewayMetrics) -> str:
    agent = NodeAgent(home, replicas, lambda *_: None)
    telemetry = PlatformTelemetry(replicas, agent, gateway, mixed_inventory, interval_s=60)

    async def once() -> bytes:
        await telemetry.start()  # takes the first device sample in a thread
        while telemetry.devices.num_samples == 0:
            await asyncio.sleep(0.01)
        try:
            return await telemetry.render()
        finally:
            await telemetry.close()

    return asyncio.run(once()).decode()


def test_exposition_round_trip(tmp_path: Path) -> None:
    replicas = ReplicaSet()
    # a ready replica whose worker does not answer (nothing listens on port 9)
    gone = Replica(
        "wl-1-r0",
        "wl-1",
        "smollm2",
        "cpu:0",
        "http://127.0.0.1:9",
        ready=True,
        priority="high",
        max_queue=8,
    )
    gone.in_flight = 3
    replicas.upsert(gone)
    gateway = GatewayMetrics()
    for status, seconds in ((200, 0.02), (200, 0.3), (502, 0.04)):
        arrived = time.perf_counter() - seconds
        gateway.finished("smollm2", "wl-1-r0", "high", status, arrived, arrived + 0.0002)
    gateway.refused("nonsense", False, ModelNotFound("no such model"))
    gateway.refused("smollm2", True, QueueFull("full"))
    text = render(tmp_path, replicas, gateway)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {
        "kunlun_requests",
        "kunlun_device_utilization_percent",
        "kunlun_replica_info",
        "kunlun_platform_resident_memory_bytes",
        "kunlun_scheduler_decisions",
    } <= names
    snapshot = parse(text)
    devices = {d["device"]: d for d in snapshot.devices}
    assert devices["nvidia:0"]["temperature_c"] == 38.0
    assert devices["nvidia:0"]["memory_total_bytes"] == 15360 * 2**20
    assert devices["nvidia:0"]["memory_bandwidth_bytes_per_s"] == 320e9
    assert devices["ascend:0"]["device_type"] == "ascend"
    (row,) = snapshot.replicas
    assert (row["model"], row["priority"], row["device"], row["device_type"]) == (
        "smollm2",
        "high",
        "cpu:0",
        "cpu",
    )
    assert (row["queue_depth"], row["queue_limit"], row["ready"]) == (3, 8, 1)
    assert row["requests"] == {"200": 2, "502": 1}
    # e2e 20, 40, 300 ms: the median (rank 1.5) lies in the (25, 50] ms bucket, interpolated
    assert row["e2e_p50_s"] == pytest.approx(0.0375)
    assert row["gateway_queue_p50_s"] == pytest.approx(0.0003)  # 3 in (0.1, 0.5] ms
    assert "ttft_p50_s" not in row  # the worker did not answer: no engine series
    assert snapshot.platform["refused"] == {"404": 1, "429": 1}
    assert snapshot.platform["resident_memory_bytes"] > 10 * 2**20
    assert 'kunlun_replica_scrape_up{model="smollm2",priority="high",replica="wl-1-r0"} 0.0' in text
    assert 'kunlun_scheduler_decisions_total{decision="model_not_found",model="-"' in text
    assert 'decision="queue_full",model="smollm2"' in text
    ascend = snapshot.filtered({"device_type": "ascend"})
    assert {d["device"] for d in ascend.devices} == {f"ascend:{i}" for i in range(4)}
    assert ascend.replicas == []
    cpu = snapshot.filtered(parse_filters(["device_type=cpu"]))
    assert cpu.devices == [] and len(cpu.replicas) == 1  # the recordings have no lscpu


def test_histogram_quantile_like_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.2, 30.0), (0.5, 40.0), (float("inf"), 40.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20 of 30 in (0.1, 0.2]
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.38)  # rank 36: 0.2 + 0.3 * 6/10
    assert histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 2.0)]) == 1.0
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


def test_bad_filters_name_the_filter() -> None:
    from kunlun.errors import ConfigError

    with pytest.raises(ConfigError, match="'device_type' is not LABEL=VALUE"):
        parse_filters(["device_type"])
    with pytest.raises(ConfigError, match="/metrics"):
        parse("this is { not an exposition")
