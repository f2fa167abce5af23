"""What the gateway keeps between requests: :class:`GatewayState`, its own module so that the
gateway's parts (intake, relay), the rollout controller and the batch API read it without
importing the gateway's routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from dataclasses import dataclass, field

from kunlun.http_client import UpstreamPool
from kunlun.limits import DEFAULT_MAX_SEQUENCES
from kunlun.serving.admission import Admission
from kunlun.serving.canary_split import Split
from kunlun.serving.canary_window import RolloutStats
from kunlun.serving.response_state import ResponseState
from kunlun.serving.routing import DeviceSamples, Router
from kunlun.serving.scheduler_config import SchedulerConfigSource
from kunlun.telemetry.gateway_metrics import GatewayMetrics  # telemetry

TICK_S = 0.2
"""How often the background task looks at the scheduler config and the backlogs."""

logger = logging.getLogger(__name__)


@dataclass
class GatewayState:
    """What the gateway keeps between requests; the daemon calls :meth:`start` and
    :meth:`close` from its lifespan and sets :attr:`draining` on SIGTERM."""

    draining: bool = False
    """New requests get 503 (in-flight ones finish)."""
    retry_after_s: int = 1
    """``Retry-After`` sent with 429 and 503 answers."""
    connect_timeout_s: float = 5.0
    """How long to wait for a worker to accept a connection."""
    first_byte_timeout_s: float | None = 900.0
    """How long to wait for a worker's response head (a non-streamed response comes
    whole, once generated; None: no limit): past it, 504."""
    read_timeout_s: float | None = 300.0
    """Longest silence between two pieces of a worker's response body (None: no limit):
    past it, the stream ends with a 504 error event."""
    direct_streams: bool = True
    """Streamed answers of this node's workers go straight from the worker to the client's
    connection (:mod:`kunlun.serving.handoff`; ``kunlun-platform --no-direct-streams``: all
    through the gateway's relay)."""
    num_active: int = 0
    """Requests admitted or waiting and not yet answered, over all replicas (for draining)."""
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES
    """Most sequences (prompts x ``n``) one request may ask for; more is a 400
    (``kunlun-platform --max-sequences-per-request``)."""
    scheduler: SchedulerConfigSource = field(default_factory=SchedulerConfigSource)
    """``scheduler_config.yaml`` in force (reloaded when the file changes, and on SIGHUP)."""
    samples: DeviceSamples = field(default_factory=DeviceSamples)
    """Device id -> latest :class:`~kunlun.serving.routing.DeviceLoad`; telemetry writes it."""
    router: Router = field(init=False, repr=False)
    admission: Admission | None = field(default=None, repr=False)
    """Slots and backlogs (made by :func:`gateway_router`)."""
    upstream: UpstreamPool | None = field(default=None, repr=False)
    """Shared keep-alive connections to the workers (made by :meth:`start`)."""
    upstream_ssl: ssl.SSLContext | None = field(default=None, repr=False)
    """In a cluster: TLS for other nodes' peer ports (their replicas' ``https://`` URLs)."""
    responses: ResponseState | None = field(default=None, repr=False)
    """The Responses API's kept answers (the daemon's state store); None: none are kept."""
    splits: dict[str, Split] = field(default_factory=dict)
    """Model name -> its rollout's traffic split (set by the rollout controller)."""
    rollout_stats: RolloutStats = field(default_factory=RolloutStats, repr=False)
    """Each rollout version's requests, errors and latencies per step (for its gates)."""
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics, repr=False)  # telemetry
    """Request counters and latency histograms (part of the daemon's ``/metrics``)."""
    _ticker: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.router = Router(self.scheduler, self.samples)

    async def start(self) -> None:
        """Open the connection pool and start the background task that reloads the scheduler
        config and moves the backlogs (call from the app's lifespan, in its event loop).
        In the main thread, SIGHUP reloads the scheduler config too."""
        if self.upstream is None:
            self.upstream = UpstreamPool(
                connect_timeout_s=self.connect_timeout_s,
                first_byte_timeout_s=self.first_byte_timeout_s,
                read_timeout_s=self.read_timeout_s,
                ssl_context=self.upstream_ssl,
            )
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick())
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.scheduler.reload)

    async def close(self) -> None:
        """Stop the background task and close every pooled connection."""
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.cancel()
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            await upstream.close()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.scheduler.poll()
                if self.admission is not None and self.admission.num_waiting():
                    self.admission.dispatch_all(self.retry_after_s)
            except Exception:  # keep serving; the next tick tries again
                logger.exception("gateway background task")
