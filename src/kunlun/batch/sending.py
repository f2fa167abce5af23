"""One request of a batch job, sent until it is answered for good.

A request goes through a :data:`Send` (the daemon passes its own gateway, in-process) with
``X-Request-Id: <batch_id>:<custom_id>:<attempt>``. :func:`send_line` sends it again while
the answer says "not now" (429, 503: :data:`WAIT_STATUSES`), for as long as the job lives
and without counting a failure, waiting as :data:`WAIT_POLICY` says; a transport failure or
another retryable answer (408, 5xx) is sent again as the job's
:class:`~kunlun.batch.retry.RetryPolicy` allows. Then the answer, or what went wrong,
becomes the line of the job's output file (2xx) or error file. Kept apart from
:class:`~kunlun.batch.jobs.BatchJobs`, which runs a job's lines through it, a bounded
number at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kunlun.batch.files import BatchLine
from kunlun.batch.objects import answer_line, failure_line
from kunlun.batch.retry import RetryPolicy, is_retryable, retry_after_s

WAIT_STATUSES = frozenset({429, 503})
""""Not now" answers (queue full, replica still loading): waited out, not counted as
failures, for as long as the job lives."""
WAIT_POLICY = RetryPolicy(max_retries=0, base_delay_s=1.0, max_delay_s=30.0)
"""How long a line waits after its n-th "not now" in a row: about 1, 2, 4 ... 30 s (with
jitter), never less than the answer's ``Retry-After``. A model reloading for minutes meets a
few requests per line, not one every 1.5 s (1,615 503s were logged once)."""


@dataclass(frozen=True)
class Reply:
    """An answer from the endpoint."""

    status: int
    headers: Mapping[str, str]
    body: bytes


Send = Callable[[str, bytes, str], Awaitable[Reply]]
"""``send(path, json_body, request_id)``: one request to the gateway."""


async def send_line(
    send: Send,
    line: BatchLine,
    batch_id: str,
    stop: asyncio.Event,
    policy: RetryPolicy,
    timeout_s: float,
) -> tuple[bool, dict[str, Any] | None]:
    """Send one request of batch ``batch_id`` until it is answered for good: (succeeded, its
    file line), or (False, None) when ``stop`` was set meanwhile (the job was cancelled or
    expired). ``policy`` retries failures; each send gets ``timeout_s``."""
    body = json.dumps(line.body).encode()
    attempt = num_failures = num_waits = 0
    while True:
        attempt += 1
        request_id = f"{batch_id}:{line.custom_id}:{attempt}"
        reply, problem = await _attempt(send, line.url, body, request_id, timeout_s)
        if reply is not None and reply.status < 300:
            return True, answer_line(
                line.custom_id, request_id, reply.status, reply.headers, reply.body
            )
        status = reply.status if reply is not None else None
        wait = retry_after_s(reply.headers.get("retry-after")) if reply is not None else None
        if status in WAIT_STATUSES:
            num_waits += 1
            delay = max(wait or 0.0, WAIT_POLICY.delay_s(num_waits))
        elif is_retryable(status) and num_failures < policy.max_retries:
            num_failures += 1
            delay = policy.delay_s(num_failures, wait)
        elif reply is not None:
            return False, answer_line(
                line.custom_id, request_id, reply.status, reply.headers, reply.body
            )
        else:
            return False, failure_line(line.custom_id, problem)
        if await _wait(stop, delay):
            return False, None


async def _attempt(
    send: Send, path: str, body: bytes, request_id: str, timeout_s: float
) -> tuple[Reply | None, str]:
    """One send: the reply, or None and what went wrong."""
    try:
        return await asyncio.wait_for(send(path, body, request_id), timeout_s), ""
    except TimeoutError:
        return None, f"no answer within {timeout_s:g}s"
    except Exception as exc:  # the gateway could not answer at all
        return None, f"{type(exc).__name__}: {exc}"


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile; True when it was."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True
