"""The daemon's server: uvicorn, but SIGTERM drains first (:class:`DrainingServer`).

A module of its own so that ``kunlun-platform --help`` and the start-up refusals, which
never serve, do not import uvicorn.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import uvicorn

DRAIN_TIMEOUT_S = 120.0


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT first drain: 503 for new requests, in-flight ones finish."""

    def __init__(self, config: uvicorn.Config, platform: Any) -> None:
        super().__init__(config)
        self.platform = platform
        self.draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.draining:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        self.platform.gateway.draining = True
        print(f"received signal {sig}: draining (new requests get 503)", flush=True)
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline and self.platform.gateway.num_active > 0:
            await asyncio.sleep(0.05)
        print("drained; stopping engine workers", flush=True)
        self.should_exit = True
