"""Liveness and forward progress of engine workers, as the node agent's supervisor sees them.

Every ``probe_interval_s`` the supervisor asks each ready worker for ``GET /stats`` (the
engine's counters), waiting at most ``probe_timeout_s``. A :class:`Liveness` per worker turns
the answers into a verdict:

- **unresponsive**: no answer for ``answer_deadline_s`` (a stopped process, a wedged event
  loop);
- **stalled**: the engine has requests unfinished and its step counter (``num_steps``) has
  not moved for ``progress_deadline_s`` (a wedged engine thread behind a live HTTP side).

Either verdict is a reason string; the supervisor then takes the replica out of routing,
kills the worker (SIGKILL) and restarts it with the normal backoff, reporting the reason.
The deadlines are generous: a long prefill is one engine step, and a worker busy with one
still answers its probes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kunlun.serving.replica import Replica

EventSink = Callable[[str, str, str], None]
"""How the node's supervisors (the agent, the health checker) report what befalls a
workload: ``(workload_id, kind, message)``."""


@dataclass(frozen=True)
class LivenessConfig:
    """How the supervisor probes workers (``kunlun-platform --worker-*`` flags)."""

    probe_interval_s: float = 1.0
    """Seconds between two probes of one worker."""
    probe_timeout_s: float = 2.0
    """Seconds one probe waits for the worker's answer."""
    answer_deadline_s: float = 15.0
    """A ready worker that answered no probe for this long is unresponsive."""
    progress_deadline_s: float = 120.0
    """A worker whose engine has requests unfinished and made no step for this long is
    stalled."""

    def __post_init__(self) -> None:
        for name in ("probe_interval_s", "probe_timeout_s", "answer_deadline_s",
                     "progress_deadline_s"):  # fmt: skip
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"LivenessConfig.{name} must be > 0, got {value!r}")


class Liveness:
    """One worker's probe history and the verdict it leads to (times from one monotonic
    clock, passed in: the class never reads the time itself)."""

    def __init__(self, config: LivenessConfig, now: float) -> None:
        self.config = config
        self.last_answer = now
        """When the worker last answered a probe (its readiness counts as one)."""
        self.num_steps: int | None = None
        self.steps_since = now
        """When ``num_steps`` last moved, or the engine was first seen with work."""
        self.busy = False
        """Whether the last answer had requests unfinished."""

    def answered(self, stats: dict[str, Any], now: float) -> str | None:
        """Record an answer (the worker's ``/stats``); the stall reason, if stalled."""
        self.last_answer = now
        steps = stats.get("num_steps")
        unfinished = stats.get("num_unfinished_requests")
        if not isinstance(steps, int) or not isinstance(unfinished, int):
            return None  # not an engine that reports steps: liveness only
        busy, self.busy = self.busy, unfinished > 0
        if steps != self.num_steps or not busy or not self.busy:
            self.num_steps, self.steps_since = steps, now  # moved, or work just arrived
            return None
        idle_for = now - self.steps_since
        if idle_for > self.config.progress_deadline_s:
            return (
                f"its engine made no step for {idle_for:.1f} s with {unfinished} request(s) "
                f"unfinished (progress deadline {self.config.progress_deadline_s:g} s)"
            )
        return None

    def missed(self, why: str, now: float) -> str | None:
        """Record a probe that got no answer (``why``); the reason, if past the deadline."""
        silent_for = now - self.last_answer
        if silent_for > self.config.answer_deadline_s:
            return (
                f"it answered no health probe for {silent_for:.1f} s (answer deadline "
                f"{self.config.answer_deadline_s:g} s; last probe: {why})"
            )
        return None


async def probe(client: httpx.AsyncClient, replica: Replica, timeout_s: float) -> dict[str, Any]:
    """The worker's ``GET /stats`` answer (with its key); for an external engine, its
    ``stats_path``: its Prometheus ``/metrics`` read into the same counters
    (:meth:`~kunlun.engines.adapter.EngineAdapter.progress`), or its health path's JSON
    object (liveness only). Raises :class:`httpx.HTTPError` (or ValueError for a body that
    is neither) when there is none within ``timeout_s``."""
    path, engine = replica.stats_path, replica.engine
    response = await client.get(replica.base_url + path, headers=replica.key_headers,
                                timeout=timeout_s)  # fmt: skip
    response.raise_for_status()
    if response.headers.get("content-type", "").startswith("text/plain"):
        from kunlun.engines.registry import engine_named

        return engine_named(engine).progress(response.text)
    stats = response.json()
    if not isinstance(stats, dict):
        raise ValueError(f"{path} answered {type(stats).__name__}, not a JSON object")
    return stats
