"""The HTTP header names the platform reads and writes, each spelled once.

Names are case-insensitive on the wire; each is written here as responses and the docs show
it, and :func:`raw` gives the lowercase bytes that raw ASGI headers carry. A module of no
imports, so that every layer (the gateway, the worker, the validator, the CLI) may ask it.
"""

from __future__ import annotations

REQUEST_ID = "X-Request-Id"
"""A request's id: passed on from the client, else made up; on every answer and log line."""
DEVICE = "X-Kunlun-Device"
"""The device that answered (``cpu:0``; ``node-b/cpu:0`` when relayed by a peer node)."""
REPLICA = "X-Kunlun-Replica"
"""The replica that answered."""
PRIORITY = "X-Kunlun-Priority"
"""A request's class (``high``, ``normal``, ``low``), over its API key's."""
POOL = "X-Kunlun-Pool"
"""Route only to this pool's replicas (a device type, or device type/engine)."""
SESSION = "X-Kunlun-Session"
"""During a rollout, the session whose hash picks the version (the same one each time)."""
VERSION = "X-Kunlun-Version"
"""During a rollout, the version that answered (``canary:wl-3f2a1b``)."""
HEALTH_PROBE = "X-Kunlun-Health-Probe"
"""Sent by the platform's own health probes (exempt from injected faults)."""
WORKER_KEY = "X-Kunlun-Worker-Key"
"""Sent by a node's daemon with every request to one of its own workers: the key of that
worker's start (its launch's ``access_key``). A worker started with a key answers 401 to any
request without it, so that no other local process reaches the model past the gateway."""
PREVIOUS_RESPONSE = "X-Kunlun-Previous-Response"
"""Sent by the gateway to a worker with a Responses API request whose ``previous_response_id``
it resolved (the worker echoes the id; :mod:`kunlun.serving.response_state`)."""


def raw(name: str) -> bytes:
    """``name`` as a raw ASGI header name: lowercase ASCII bytes."""
    return name.lower().encode("ascii")
