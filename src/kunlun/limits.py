"""Figures and names the gateway's edge is defined by, kept free of imports so that the daemon's
command line and request log can read them without loading the web stack."""

from __future__ import annotations

DEFAULT_MAX_SEQUENCES = 256
"""Most sequences (prompts x ``n``) one inference request may ask for, by default
(``kunlun-platform --max-sequences-per-request``, ``KUNLUN_MAX_SEQUENCES_PER_REQUEST``)."""
CLIENT_GONE = 499
"""Status counted and logged when the client disconnects before its answer is complete
(while it waits in the gateway's queue, or mid-stream)."""
PRIORITIES = ("high", "normal", "low")
"""The priority classes of requests, API keys and workloads, most urgent first (ties in the
gateway's fair queuing go to the earlier one)."""


def seconds_from_env(name: str, default: float, most: float | None = None) -> float:
    """``$name`` as a number of seconds (more than 0, at most ``most``), or ``default`` when
    unset; anything else is a :class:`~kunlun.errors.ConfigError` naming the variable."""
    import math
    import os

    from kunlun.errors import ConfigError

    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and (most is None or value <= most)):
        bound = "" if most is None else f" of at most {most:g}"
        raise ConfigError(f"{name}={raw!r} is not a positive number of seconds{bound}")
    return value
