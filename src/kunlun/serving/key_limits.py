"""Per-key limits: requests and tokens per minute, and the client networks a key may use.

A key's own values (``apikey create --rpm --tpm --allow-ip``) override the daemon's defaults
(``api_keys:`` in ``scheduler_config.yaml``, reloaded live); 0 means no limit.

Each rate is a token bucket per key that holds one minute's worth and refills continuously:
``rpm: 60`` allows a burst of 60 requests, then one a second. Over any minute that is at
most twice the limit at the very start and the limit on average afterwards, and a client
that exhausted it waits for the next slot, not for a whole minute. A refusal is 429 with
``Retry-After``: the seconds until the bucket holds enough again (rounded up, at least 1).

- **Requests** are counted when they arrive, on every route the key is used on.
- **Tokens** are counted on the inference routes (``/v1/chat/completions``, ``/v1/embeddings``,
  ``/v1/completions``). A request is admitted while its key's bucket is not empty; it is
  charged at once the gateway's estimate (body bytes / 4 for the prompt, plus ``max_tokens``
  (256 when unset) times ``n``), and at its end the charge is corrected to the usage the
  answer reports (``prompt_tokens + completion_tokens``: every non-streamed answer, a
  stream with ``stream_options.include_usage``). An answer with an error status is not
  charged; a stream without usage keeps the estimate. A key can thus overshoot its
  minute by the requests it has in flight, and no more.

Refusals are counted in ``/metrics`` by the key's name and id (never its secret):
``kunlun_rate_limited_requests_total{key,key_id,limit}`` (limit ``rpm`` or ``tpm``) and
``kunlun_api_key_denied_requests_total{key,key_id,reason}`` (reason ``scope`` or ``ip``).
"""

from __future__ import annotations

import ipaddress
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from kunlun.protocol.openai_errors import RateLimited
from kunlun.serving.scheduler_config import KeyDefaults
from kunlun.state.api_keys import ActiveKey

WINDOW_S = 60.0
"""The bucket refills its capacity (the per-minute limit) over this many seconds."""
KEY_TOKENS_SCOPE = "kunlun.key_tokens"
"""ASGI scope key of the request's :class:`TokenCharge` when its key has a token limit."""
_TOTAL_TOKENS = re.compile(rb'"total_tokens":\s*(\d+)')
_OLLAMA_COUNTS = re.compile(rb'"prompt_eval_count":\s*(\d+).*?"eval_count":\s*(\d+)')
"""The usage at the end of an Ollama answer (prompt and output tokens)."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class KeyPolicy:
    """The limits in force for one key (its own, else the daemon's defaults)."""

    rpm: int | None
    tpm: int | None
    allow_ips: tuple[Network, ...] | None

    def allows(self, address: str | None) -> bool:
        """Whether a client at ``address`` may use the key (any, without an allow-list)."""
        if self.allow_ips is None:
            return True
        try:
            ip = ipaddress.ip_address(address or "")
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in self.allow_ips)


class _Bucket:
    """``level`` units out of ``capacity``, refilled at ``capacity`` per :data:`WINDOW_S`."""

    __slots__ = ("level", "updated")

    def __init__(self, capacity: int, now: float) -> None:
        self.level, self.updated = float(capacity), now

    def refill(self, capacity: int, now: float) -> None:
        rate = capacity / WINDOW_S
        self.level = min(float(capacity), self.level + (now - self.updated) * rate)
        self.updated = now

    def wait_s(self, capacity: int, needed: float) -> float:
        """Seconds until the level reaches ``needed`` (after a refill)."""
        return max(0.0, (needed - self.level) * WINDOW_S / capacity)


class TokenCharge:
    """One inference request's tokens against its key's bucket: :meth:`admit` at admission
    (the gateway calls it with its estimate), :meth:`settle` when the answer is over."""

    __slots__ = ("charged", "key", "limiter", "tpm")

    def __init__(self, limiter: KeyLimiter, key: ActiveKey, tpm: int) -> None:
        self.limiter, self.key, self.tpm = limiter, key, tpm
        self.charged = 0

    def admit(self, estimate: int) -> None:
        """Charge ``estimate`` tokens, or raise :class:`RateLimited` when the key's tokens
        for the minute are used up."""
        self.limiter.charge_tokens(self.key, self.tpm, estimate)
        self.charged = estimate

    def settle(self, status: int | None, tail: bytes) -> None:
        """Correct the charge to the usage reported at the end of the answer (``tail``: its
        last bytes); nothing for an error status; the estimate when there is no usage."""
        if not self.charged:
            return
        actual = self.charged
        if status is None or status >= 400:
            actual = 0
        else:
            found = _TOTAL_TOKENS.findall(tail)
            counts = _OLLAMA_COUNTS.findall(tail)
            if found:
                actual = int(found[-1])
            elif counts:
                actual = int(counts[-1][0]) + int(counts[-1][1])
        if actual != self.charged:
            self.limiter.adjust_tokens(self.key, self.tpm, actual - self.charged)
        self.charged = 0


class KeyLimiter:
    """Every key's buckets, and the refusal counters (in ``registry``, part of ``/metrics``).

    ``defaults`` returns the daemon's defaults in force (read on every request, so a
    reloaded ``scheduler_config.yaml`` applies at once)."""

    def __init__(
        self,
        defaults: Callable[[], KeyDefaults],
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._defaults = defaults
        self._clock = clock
        self._lock = threading.Lock()
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        self._default_networks: tuple[list[str] | None, tuple[Network, ...] | None] = (None, None)
        self.limited = Counter(
            "kunlun_rate_limited_requests",
            "Requests refused with 429 because their API key used its requests (rpm) or "
            "tokens (tpm) per minute.",
            ["key", "key_id", "limit"],
            registry=registry,
        )
        self.denied = Counter(
            "kunlun_api_key_denied_requests",
            "Requests refused with 403 although their API key is valid: a route outside the "
            "key's scope, or a client address outside its allow-list.",
            ["key", "key_id", "reason"],
            registry=registry,
        )

    def policy(self, key: ActiveKey) -> KeyPolicy:
        """The limits in force for ``key``: its own where set, else the daemon's."""
        defaults = self._defaults()
        rpm = key.rpm if key.rpm is not None else defaults.rpm
        tpm = key.tpm if key.tpm is not None else defaults.tpm
        networks = key.allow_ips
        if networks is None and defaults.allow_ips is not None:
            cached, parsed = self._default_networks
            if cached is not defaults.allow_ips:
                parsed = tuple(ipaddress.ip_network(n, strict=False) for n in defaults.allow_ips)
                self._default_networks = (defaults.allow_ips, parsed)
            networks = parsed
        return KeyPolicy(rpm or None, tpm or None, networks)

    def deny(self, key: ActiveKey, reason: str) -> None:
        """Count a 403 of a valid key (``reason``: ``scope`` or ``ip``)."""
        self.denied.labels(key.name, key.key_id, reason).inc()

    def take_request(self, key: ActiveKey, rpm: int) -> None:
        """Count one request of ``key``, or raise :class:`RateLimited` when its ``rpm`` is
        used up."""
        with self._lock:
            now = self._clock()
            bucket = self._bucket(self._requests, key.key_id, rpm, now)
            if bucket.level >= 1.0:
                bucket.level -= 1.0
                return
            wait = bucket.wait_s(rpm, 1.0)
        self._refuse(key, "rpm", f"{rpm} requests per minute", wait)

    def charge_tokens(self, key: ActiveKey, tpm: int, tokens: int) -> None:
        """Take ``tokens`` from ``key``'s bucket (it may go below zero), or raise
        :class:`RateLimited` when the bucket is empty."""
        with self._lock:
            now = self._clock()
            bucket = self._bucket(self._tokens, key.key_id, tpm, now)
            if bucket.level > 0.0:
                bucket.level -= tokens
                return
            wait = bucket.wait_s(tpm, 1.0)
        self._refuse(key, "tpm", f"{tpm} tokens per minute", wait)

    def adjust_tokens(self, key: ActiveKey, tpm: int, delta: int) -> None:
        """Add ``delta`` tokens to what ``key`` was charged (negative: give some back)."""
        with self._lock:
            now = self._clock()
            bucket = self._bucket(self._tokens, key.key_id, tpm, now)
            bucket.level = min(float(tpm), bucket.level - delta)

    def _bucket(
        self, buckets: dict[str, _Bucket], key_id: str, capacity: int, now: float
    ) -> _Bucket:
        bucket = buckets.get(key_id)
        if bucket is None:
            bucket = buckets[key_id] = _Bucket(capacity, now)
        else:
            bucket.refill(capacity, now)
        return bucket

    def _refuse(self, key: ActiveKey, limit: str, what: str, wait_s: float) -> None:
        self.limited.labels(key.name, key.key_id, limit).inc()
        retry_after = max(1, math.ceil(wait_s))
        raise RateLimited(
            f"API key {key.name!r} ({key.key_id}) has used its {what}; retry in {retry_after} s",
            retry_after_s=retry_after,
        )
