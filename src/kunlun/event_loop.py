"""The event loop a process runs: uvloop where it is installed, as uvicorn does for the daemon
(a loop and transports written in C: less CPU per read and write than asyncio's selector loop),
else asyncio's own."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


def run_event_loop(main: Coroutine[Any, Any, _T]) -> _T:
    """Run ``main`` to its end on a new loop and return its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
