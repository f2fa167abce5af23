"""Pool names: which replicas of a model a request (``X-Kunlun-Pool``) or a validation column
is restricted to. The one place that makes and parses them.

A pool is a device type, optionally narrowed to one engine: ``DEVICE_TYPE[/ENGINE]``.

- ``cpu`` (no engine): every replica on a ``cpu`` device, whatever engine serves it. This is
  what the header meant before external engines existed, and it still does.
- ``cpu/llama.cpp``, ``cpu/kunlun``: only the replicas on ``cpu`` devices served by that
  engine (``Replica.engine``; ``kunlun`` is the embedded engine).

A replica therefore answers to two names (:func:`names_of`). :func:`columns_of` names the pools
``kunlun-cli validate --all-pools`` makes one column each of: a device type served by one
engine keeps its plain name (a saved baseline's column names stay valid); a device type
served by several engines gets one engine-qualified pool per engine, so that each column
measures one engine and no request of it lands on the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

SEPARATOR = "/"


class Pool(NamedTuple):
    """A parsed pool name."""

    device_type: str
    engine: str | None
    """None: any engine."""


def pool_name(device_type: str, engine: str | None = None) -> str:
    """``cpu``, or ``cpu/llama.cpp`` when narrowed to an engine."""
    return device_type if engine is None else f"{device_type}{SEPARATOR}{engine}"


def parse_pool(value: str) -> Pool:
    """The pool ``value`` names; a ValueError saying what is wrong with a malformed one (empty,
    an empty side of the ``/``, more than one ``/``, blanks inside)."""
    text = value.strip()
    device_type, sep, engine = text.partition(SEPARATOR)
    if (
        not device_type
        or (sep and not engine)
        or SEPARATOR in engine
        or any(c.isspace() for c in text)
    ):
        raise ValueError(
            f"{value!r} is not a pool: expected DEVICE_TYPE or DEVICE_TYPE/ENGINE, "
            "e.g. cpu or cpu/llama.cpp"
        )
    return Pool(device_type, engine or None)


def names_of(device_type: str, engine: str) -> frozenset[str]:
    """The pool names a replica on ``device_type`` served by ``engine`` answers to."""
    return frozenset((pool_name(device_type), pool_name(device_type, engine)))


def columns_of(served: Iterable[tuple[str, str]]) -> list[str]:
    """The pools to validate, one per column, from the ``(device type, engine)`` pairs serving
    a model: the plain device type where one engine serves it, else one pool per engine."""
    engines: dict[str, set[str]] = {}
    for device_type, engine in served:
        engines.setdefault(device_type, set()).add(engine)
    names = []
    for device_type, found in engines.items():
        if len(found) == 1:
            names.append(pool_name(device_type))
        else:
            names += [pool_name(device_type, engine) for engine in found]
    return sorted(names)
