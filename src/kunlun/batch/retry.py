"""When to retry a request, and how long to wait first.

Retried: timeouts and connection errors (no status), 408, 429 and every 5xx; a
``Retry-After`` header is honoured. Not retried: every other 4xx (400 bad request, 401 bad
key, 404 unknown model...), since sending the same request again cannot change the answer.
Waits grow exponentially with "equal jitter" (half fixed, half random), so many clients
that failed together do not come back together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

RETRYABLE_STATUSES = frozenset({408, 429})


def is_retryable(status: int | None) -> bool:
    """True for a transport failure (``None``), 408, 429 and 5xx."""
    return status is None or status in RETRYABLE_STATUSES or status >= 500


def retry_after_s(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent
    or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


@dataclass(frozen=True)
class RetryPolicy:
    """How many times to retry and how long to wait between attempts."""

    max_retries: int = 3
    """Retries after the first attempt (so at most ``max_retries + 1`` attempts)."""
    base_delay_s: float = 0.5
    """The wait before the first retry; doubles with each further retry."""
    max_delay_s: float = 30.0
    """No wait is longer than this (a longer ``Retry-After`` is cut to it)."""

    def delay_s(self, retry: int, retry_after: float | None = None) -> float:
        """The wait before retry number ``retry`` (1 for the first). ``Retry-After``, when
        the server sent one, replaces the computed wait."""
        if retry_after is not None:
            return min(retry_after, self.max_delay_s)
        ceiling = min(self.max_delay_s, self.base_delay_s * 2 ** (retry - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)
