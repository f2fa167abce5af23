"""The device collector: samples every device plugin periodically, off the event loop.

:class:`DeviceCollector` calls an inventory function (the daemon passes its own, which runs
every plugin and merges ``device-plugin-config.yaml``) in a worker thread every
``interval_s`` seconds and keeps the latest :class:`DeviceSample` per device id. Readers
(``/metrics``, the gateway's load-aware routing) call :meth:`DeviceCollector.latest`, which
never blocks on a plugin. A sample that fails (a plugin error, a config file broken since
start-up) keeps the previous samples and is counted in ``num_errors`` with its message.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kunlun.device.inventory import Inventory
from kunlun.limits import seconds_from_env

DEFAULT_INTERVAL_S = 5.0
INTERVAL_ENV = "KUNLUN_TELEMETRY_INTERVAL_S"


def interval_from_env() -> float:
    """``$KUNLUN_TELEMETRY_INTERVAL_S`` or :data:`DEFAULT_INTERVAL_S`."""
    return seconds_from_env(INTERVAL_ENV, DEFAULT_INTERVAL_S)


@dataclass(frozen=True)
class DeviceSample:
    """One device at one moment; ``None`` where its plugin does not report the figure."""

    device_id: str
    """``TYPE:INDEX``, as in the inventory and ``Replica.device``."""
    device_type: str
    status: str
    """Inventory status: Ready, Degraded, Unhealthy or Excluded."""
    ts: float
    """When it was taken (``time.time()``)."""
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    memory_used_mb: int | None = None
    memory_total_mb: int | None = None
    memory_bandwidth_util_pct: float | None = None
    """Share of time device memory was being read or written (NVML's memory utilization)."""
    memory_bandwidth_gbps: float | None = None
    """Peak memory bandwidth as declared in ``device-plugin-config.yaml``."""


def samples_from(inventory: Inventory, ts: float) -> dict[str, DeviceSample]:
    """One sample per device profile of ``inventory``, keyed by device id."""
    out = {}
    for profile in inventory.profiles:
        out[profile.id] = DeviceSample(
            device_id=profile.id,
            device_type=profile.device_type,
            status=profile.status.value,
            ts=ts,
            utilization_pct=_number(profile.get("utilization_pct")),
            temperature_c=_number(profile.get("temperature_c")),
            power_w=_number(profile.get("power_w")),
            memory_used_mb=profile.get("memory_used_mb"),
            memory_total_mb=profile.get("memory_total_mb"),
            memory_bandwidth_util_pct=_number(profile.get("memory_bandwidth_util_pct")),
            memory_bandwidth_gbps=_number(profile.get("memory_bandwidth_gbps")),
        )
    return out


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class DeviceCollector:
    """Samples devices every ``interval_s`` seconds through ``inventory`` (see the module)."""

    def __init__(
        self, inventory: Callable[[], Inventory], interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s} must be > 0")
        self.inventory = inventory
        self.interval_s = interval_s
        self.num_samples = 0
        self.num_errors = 0
        self.last_error: str | None = None
        self.last_duration_s: float | None = None
        self._latest: dict[str, DeviceSample] = {}
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        self.listeners: list[Callable[[dict[str, DeviceSample]], None]] = []
        """Called with each new sample, in the event loop's thread (e.g. gateway routing)."""

    def latest(self) -> dict[str, DeviceSample]:
        """The newest sample of every device (empty before the first one completes)."""
        with self._lock:
            return dict(self._latest)

    def sample_once(self) -> dict[str, DeviceSample]:
        """Take one sample now, in this thread (blocks while the plugins run)."""
        started = time.monotonic()
        try:
            samples = samples_from(self.inventory(), time.time())
        except Exception as exc:  # noqa: BLE001 - a bad sample must not stop the collector
            with self._lock:
                self.num_errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            return self.latest()
        with self._lock:
            self._latest = samples
            self.num_samples += 1
            self.last_duration_s = time.monotonic() - started
        return samples

    async def run(self) -> None:
        """Sample forever, each time in a worker thread."""
        while True:
            samples = await asyncio.to_thread(self.sample_once)
            for listener in self.listeners:
                try:
                    listener(samples)
                except Exception as exc:  # noqa: BLE001 - a listener must not stop sampling
                    self.last_error = f"listener {listener!r}: {type(exc).__name__}: {exc}"
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Start :meth:`run` as a task of the running event loop (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
