"""Fault injection: a documented way to make a workload's workers fail or slow down requests
on purpose, to test what watches them (rollout gates, dashboards, alerts) with a real broken
version instead of a mock.

A workload spec's ``faults`` (:class:`~kunlun.engine.launch.FaultSpec`) reaches each worker in its launch
(:class:`~kunlun.engine.launch.EngineLaunch`). Each chat or completion request then

- waits ``delay_ms`` before it is given to the engine (its time to first token and its
  end-to-end time grow by that much), and
- with probability ``error_rate`` is answered ``500`` with an engine error of code
  ``fault_injected`` instead of being run.

The platform's own health probes (header ``X-Kunlun-Health-Probe``) are exempt: a fault
injected to test rollout gates does not also take the replica out of routing.

``step_delay_ms`` is the one fault of the engine rather than of a request: the engine thread
waits that long after every step (:class:`~kunlun.engine.async_engine.AsyncLLMEngine`'s
``step_delay_s``), as a slow device would, so every token of every request (probes too) comes
later and a streamed answer is spread out in time however fast the model is.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping

from kunlun import headers as http_headers
from kunlun.engine.launch import FaultSpec
from kunlun.errors import KunlunError

PROBE_HEADER = http_headers.HEALTH_PROBE
"""Sent (value ``1``) with every health probe of :mod:`kunlun.node.health`, so a worker can
tell probes from client requests: injected faults leave probes alone."""


class InjectedFault(KunlunError):
    """An engine error the workload's ``faults.error_rate`` asked for."""

    code = "fault_injected"
    http_status = 500
    openai_type = "server_error"


class Faults:
    """Applies a :class:`FaultSpec` to the requests of one worker."""

    def __init__(self, spec: FaultSpec | None) -> None:
        self.spec = spec if spec is not None and (spec.error_rate or spec.delay_ms) else None
        self._rng = random.Random(spec.seed if spec is not None else None)

    async def apply(self, headers: Mapping[str, str]) -> None:
        """Delay, then maybe raise :class:`InjectedFault`; nothing for a health probe or
        when no fault is set. ``headers``: the request's (a Starlette ``Headers``)."""
        spec = self.spec
        if spec is None or headers.get(PROBE_HEADER):
            return
        if spec.delay_ms:
            await asyncio.sleep(spec.delay_ms / 1000.0)
        if spec.error_rate and self._rng.random() < spec.error_rate:
            raise InjectedFault(
                f"fault injected by the workload's faults.error_rate ({spec.error_rate:g})",
                hint="remove 'faults' from the workload spec to serve normally",
            )
