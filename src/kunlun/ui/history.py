"""The Metrics page's history: the daemon samples its own ``/metrics`` and keeps the last minutes.

A page that drew only what it polled itself opened blank, lost everything on a reload and
showed nothing of the minutes before it was opened. :class:`MetricsHistory` runs with the
daemon (started and stopped by the dashboard with the app's lifespan): every
``interval_s`` it renders the exposition in-process (no HTTP, no key: the same text
``GET /metrics`` answers), reads it once, in a thread (parsing it is milliseconds of CPU per
replica, which the event loop relaying every stream must not wait for), and keeps one
:class:`Point` per sample for ``keep_s`` seconds: per replica its model, device, queue depth
and KV cache use, and per replica, device and priority class the figures of the window since
the sample before (:func:`~kunlun.ui.windows.window`). Every page load reads the same
history (``/ui/metrics.json``), then asks only for the points after the last one it has.

A sample that fails (a worker's scrape erroring in an unexpected way) is printed once per
distinct error and skipped; the sampling goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from kunlun.limits import seconds_from_env
from kunlun.telemetry.view import Snapshot, metric_families, snapshot
from kunlun.ui.windows import Scrape, scrape, window

INTERVAL_ENV = "KUNLUN_UI_SAMPLE_S"
"""Seconds between two samples (default :data:`DEFAULT_INTERVAL_S`)."""
DEFAULT_INTERVAL_S = 5.0
KEEP_S = 900.0
"""The history kept: the last 15 minutes."""
FIGURES = ("model", "device", "queue_depth", "kv_cache_usage")
"""What each replica's row carries from the scrape itself (the window adds the rest)."""

Point = dict[str, Any]
"""One sample: ``ts``, ``window_s`` (None for the first), ``replicas``, ``devices`` and
``priorities`` (each name to its figures)."""


def interval_from_env() -> float:
    """``$KUNLUN_UI_SAMPLE_S`` or :data:`DEFAULT_INTERVAL_S`; a ConfigError naming the
    variable for anything but a positive number of seconds up to a minute."""
    return seconds_from_env(INTERVAL_ENV, DEFAULT_INTERVAL_S, most=60)


class MetricsHistory:
    """The sampled points of the last :data:`KEEP_S` seconds (see the module docstring)."""

    def __init__(
        self,
        render: Callable[[], Awaitable[bytes | str]],
        interval_s: float | None = None,
        keep_s: float = KEEP_S,
    ) -> None:
        self.render = render
        self.interval_s = interval_from_env() if interval_s is None else interval_s
        self.keep_s = keep_s
        self.points: deque[Point] = deque(maxlen=int(keep_s / self.interval_s) + 1)
        self._last: Scrape | None = None
        self._task: asyncio.Task[None] | None = None
        self._reported: set[str] = set()

    async def sample(self) -> Point:
        """Render, read and keep one point; the point."""
        raw = await self.render()
        text = raw.decode() if isinstance(raw, bytes) else raw
        now, rows = await asyncio.to_thread(_read, text, time.time())
        windowed = window(now, self._last)
        span = None if self._last is None else now.ts - self._last.ts
        self._last = now
        replicas = {}
        for row in rows.replicas:
            rid = str(row["replica"])
            replicas[rid] = {k: row.get(k) for k in FIGURES} | windowed.get("replica", {}).get(
                rid, {}
            )
        point: Point = {
            "ts": now.ts,
            "window_s": span,
            "replicas": replicas,
            "devices": windowed.get("device", {}),
            "priorities": windowed.get("priority", {}),
        }
        self.points.append(point)
        return point

    def after(self, ts: float | None) -> list[Point]:
        """The points kept, oldest first; only those sampled after ``ts`` when given."""
        return [p for p in self.points if ts is None or p["ts"] > ts]

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled."""
        while True:
            started = time.monotonic()
            try:
                await self.sample()
            except Exception as exc:  # noqa: BLE001 - one bad sample must not end the history
                said = f"{type(exc).__name__}: {exc}"
                if said not in self._reported:
                    self._reported.add(said)
                    print(f"dashboard metrics sample failed (reported once): {said}", flush=True)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _read(text: str, ts: float) -> tuple[Scrape, Snapshot]:
    """One exposition read once into its :class:`Scrape` (taken at ``ts``) and its rows."""
    families = metric_families(text)
    return scrape(families, ts), snapshot(families)
