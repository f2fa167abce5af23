"""The Metrics page's history (:class:`kunlun.ui.history.MetricsHistory`) over real
Prometheus expositions (``prometheus_client``, the library the daemon and its workers
write theirs with): windows between samples, the points after a time, the bound on what is
kept, a failing sample reported once without ending the sampling, and the interval's check."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kunlun.errors import ConfigError
from kunlun.ui.history import INTERVAL_ENV, MetricsHistory, interval_from_env

LABELS = ("model", "replica", "priority", "device")


class Node:
    """One replica's metrics as the daemon's ``/metrics`` names and labels them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        info = Gauge("kunlun_replica_info", "replica", [*LABELS[:3], "workload", "device",
                     "device_type", "engine"], registry=self.registry)  # fmt: skip
        info.labels("tiny", "r1", "normal", "w1", "cpu:0", "cpu", "kunlun").set(1)
        self.ttft = Histogram("kunlun_time_to_first_token_seconds", "ttft", LABELS,
                              buckets=(0.1, 1.0), registry=self.registry).labels(
                                  "tiny", "r1", "normal", "cpu:0")  # fmt: skip
        self.tokens = Counter("kunlun_generation_tokens", "tokens", LABELS,
                              registry=self.registry).labels("tiny", "r1", "normal", "cpu:0")  # fmt: skip

    async def render(self) -> bytes:
        return generate_latest(self.registry)


def test_windows_between_samples_and_the_points_after_a_time() -> None:
    async def scenario() -> None:
        node = Node()
        history = MetricsHistory(node.render, interval_s=0.05, keep_s=0.2)
        first = await history.sample()
        assert first["window_s"] is None
        assert first["replicas"]["r1"]["model"] == "tiny"
        assert first["replicas"]["r1"]["device"] == "cpu:0"
        assert first["replicas"]["r1"]["ttft_p50_s"] is None  # no window yet
        for _ in range(3):
            node.ttft.observe(0.05)
        node.tokens.inc(30)
        await asyncio.sleep(0.01)
        second = await history.sample()
        replica = second["replicas"]["r1"]
        assert 0 < replica["ttft_p99_s"] <= 0.1 and replica["tokens_per_s"] > 0
        assert second["devices"]["cpu:0"]["ttft_p50_s"] == replica["ttft_p50_s"]
        assert second["window_s"] > 0
        third = await history.sample()  # nothing finished in between
        assert third["replicas"]["r1"]["ttft_p50_s"] is None
        assert third["replicas"]["r1"]["tokens_per_s"] == 0
        assert history.after(second["ts"]) == [third]
        assert history.after(None) == [first, second, third]
        for _ in range(10):
            await history.sample()
        assert len(history.points) == 5  # keep_s / interval_s + 1: the oldest went first
        assert history.points[0]["ts"] > third["ts"]

    asyncio.run(scenario())


def test_a_failing_sample_is_reported_once_and_sampling_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def scenario() -> int:
        node = Node()
        failures = 0

        async def flaky() -> bytes:
            nonlocal failures
            if failures < 3:
                failures += 1
                raise OSError("worker scrape broke")
            return await node.render()

        history = MetricsHistory(flaky, interval_s=0.01)
        history.start()
        for _ in range(500):
            if history.points:
                break
            await asyncio.sleep(0.01)
        await history.stop()
        return len(history.points)

    assert asyncio.run(scenario()) >= 1
    said = capsys.readouterr().out
    assert said.count("dashboard metrics sample failed") == 1, said
    assert "OSError: worker scrape broke" in said


@pytest.mark.parametrize("value", ["0", "-1", "61", "often", "nan"])
def test_the_sample_interval_is_checked(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(INTERVAL_ENV, value)
    with pytest.raises(ConfigError, match=INTERVAL_ENV):
        interval_from_env()


def test_the_sample_interval_defaults_and_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert interval_from_env() == 5.0
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert interval_from_env() == 0.5
