"""The device collector over recorded vendor-tool output (the seed's mixed server)."""

from __future__ import annotations

import asyncio

import pytest
from tests.telemetry.conftest import mixed_inventory

from kunlun.device.inventory import Inventory
from kunlun.errors import ConfigError
from kunlun.telemetry.collector import INTERVAL_ENV, DeviceCollector, interval_from_env


def test_samples_carry_what_the_tools_reported() -> None:
    collector = DeviceCollector(mixed_inventory)
    assert collector.latest() == {}
    samples = collector.sample_once()
    assert collector.latest() == samples and collector.num_samples == 1
    # no lscpu recording, so no cpu:0
    assert set(samples) == {*(f"ascend:{i}" for i in range(4)), "cambricon:0", "cambricon:1",
                            "nvidia:0"}  # fmt: skip
    t4 = samples["nvidia:0"]  # the nvidia-smi CSV line: 15360 MiB, 0 used, 0 %, 38 C, 27.54 W
    assert (t4.device_type, t4.status) == ("nvidia", "Ready")
    assert (t4.memory_total_mb, t4.memory_used_mb) == (15360, 0)
    assert (t4.utilization_pct, t4.temperature_c, t4.power_w) == (0.0, 38.0, 27.54)
    assert t4.memory_bandwidth_gbps == 320  # declared in device-plugin-config.yaml
    for device_id, sample in samples.items():
        profile = mixed_inventory().get(device_id)
        assert profile is not None
        assert sample.utilization_pct == profile.get("utilization_pct")
        assert sample.temperature_c == profile.get("temperature_c")
        assert sample.memory_total_mb == profile.get("memory_total_mb")


def test_a_failing_sample_keeps_the_last_one() -> None:
    calls = {"n": 0}

    def flaky() -> Inventory:
        calls["n"] += 1
        if calls["n"] > 1:
            raise ConfigError("device-plugin-config.yaml:3: broken since start-up")
        return mixed_inventory()

    collector = DeviceCollector(flaky)
    first = collector.sample_once()
    assert collector.sample_once() == first
    assert collector.num_errors == 1 and "broken since start-up" in (collector.last_error or "")


def test_runs_off_the_event_loop_until_stopped() -> None:
    async def scenario() -> int:
        collector = DeviceCollector(mixed_inventory, interval_s=0.01)
        collector.start()
        for _ in range(500):
            if collector.num_samples >= 2:
                break
            await asyncio.sleep(0.02)
        await collector.stop()
        return collector.num_samples

    assert asyncio.run(scenario()) >= 2


def test_interval_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert interval_from_env() == 0.5
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    with pytest.raises(ConfigError, match="KUNLUN_TELEMETRY_INTERVAL_S='soon'"):
        interval_from_env()
    with pytest.raises(ValueError, match="interval_s=0"):
        DeviceCollector(mixed_inventory, interval_s=0)


def test_samples_reach_gateway_routing() -> None:
    """The daemon's wiring: each collected sample becomes a routing DeviceLoad, so a hot or
    busy device is seen by the load-aware policy."""
    from kunlun.daemon.app import feed_routing
    from kunlun.serving.gateway_state import GatewayState

    gateway = GatewayState()

    async def scenario() -> None:
        collector = DeviceCollector(mixed_inventory, interval_s=0.01)
        collector.listeners.append(lambda samples: feed_routing(gateway, samples))
        collector.start()
        for _ in range(500):
            if len(gateway.samples) == 7:
                break
            await asyncio.sleep(0.02)
        await collector.stop()

    asyncio.run(scenario())
    t4 = gateway.samples["nvidia:0"]
    assert (t4.utilization_pct, t4.temperature_c) == (0.0, 38.0)
    assert set(gateway.samples) == {*(f"ascend:{i}" for i in range(4)), "cambricon:0",
                                    "cambricon:1", "nvidia:0"}  # fmt: skip
