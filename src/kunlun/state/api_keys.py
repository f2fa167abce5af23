"""API keys: created once and shown once, stored only as SHA-256 hashes, checked in constant time.

A key looks like ``kl-<key_id>-<secret>``. Once any active key exists, every route but
``/healthz`` and ``/readyz`` requires one. Each key has a scope (:data:`SCOPES`): ``admin``
keys may use every route, ``inference`` keys (the default) only the OpenAI API; and,
optionally, its own requests and tokens per minute and client networks (CIDRs), which
override the daemon's defaults (:mod:`kunlun.serving.key_limits` enforces them).
:class:`KeyRing` is the daemon's view: it re-reads the store only when another process
(``kunlun-cli apikey ...`` working on ``KUNLUN_HOME`` directly) has changed it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kunlun.errors import ClusterUnavailable, ConfigError, Location, RequestError
from kunlun.limits import PRIORITIES
from kunlun.state.store import ApiKeyRecord, StateStore

PREFIX = "kl-"


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


SCOPES = ("admin", "inference")
"""``admin``: every route; ``inference``: the OpenAI API (``/v1/...``, ``/metrics``) only."""
DEFAULT_SCOPE = "inference"
MAX_PER_MINUTE = 1_000_000_000
"""The largest ``rpm`` or ``tpm`` a key may set."""
MAX_NETWORKS = 64
"""The most CIDRs in one allow-list."""


def create_key(
    store: StateStore,
    name: str,
    priority: str | None = None,
    scope: str = DEFAULT_SCOPE,
    rpm: int | None = None,
    tpm: int | None = None,
    allow_ips: Sequence[str] | str | None = None,
) -> tuple[ApiKeyRecord, str]:
    """A new key; returns its record and the secret, which is never stored or shown again.
    ``priority`` (high, normal, low) sets the class of the key's requests (overriding the
    workload's; the ``X-Kunlun-Priority`` header overrides it in turn). ``scope``: see
    :data:`SCOPES`. ``rpm``/``tpm``: requests/tokens per minute (None: the daemon's default,
    0: no limit); ``allow_ips``: CIDRs, as a list or comma-separated (None: the daemon's
    default). A bad value raises :class:`RequestError` naming the field."""
    name = name.strip()
    if not name or len(name) > 64:
        raise RequestError(f"key name must be 1-64 characters, got {name!r}")
    if priority is not None and priority not in PRIORITIES:
        raise RequestError(
            f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}",
            location=Location("--priority"),
        )
    if scope not in SCOPES:
        raise RequestError(
            f"scope must be one of {', '.join(SCOPES)}, got {scope!r}",
            location=Location("--scope"),
        )
    key_id = secrets.token_hex(4)
    secret = f"{PREFIX}{key_id}-{secrets.token_urlsafe(24)}"
    record = ApiKeyRecord(
        key_id=key_id,
        name=name,
        key_hash=hash_key(secret),
        created=time.time(),
        priority=priority,
        scope=scope,
        rpm=check_per_minute(rpm, "--rpm"),
        tpm=check_per_minute(tpm, "--tpm"),
        allow_ips=check_networks(allow_ips, "--allow-ip"),
    )
    store.put_api_key(record)
    return record, secret


def check_per_minute(value: object, field: str) -> int | None:
    """``value`` as a per-minute limit (None, or 0 for none, to :data:`MAX_PER_MINUTE`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PER_MINUTE:
        raise RequestError(
            f"must be a whole number from 0 (no limit) to {MAX_PER_MINUTE}, got {value!r}",
            location=Location(field),
        )
    return value


def check_networks(value: Sequence[str] | str | None, field: str) -> list[str] | None:
    """``value`` (CIDRs, a list or comma-separated) as normalized network strings; a bare
    address is a /32 (or /128) network. None stays None."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or len(items) > MAX_NETWORKS:
        raise RequestError(
            f"must be a list of at most {MAX_NETWORKS} CIDRs, got {value!r}",
            location=Location(field),
        )
    networks = []
    for item in items:
        try:
            if not isinstance(item, str):
                raise ValueError("not a string")
            networks.append(str(ipaddress.ip_network(item.strip(), strict=False)))
        except ValueError as exc:
            raise RequestError(
                f"{item!r} is not a network such as 10.0.0.0/8 or 2001:db8::/32 ({exc})",
                location=Location(field),
            ) from None
    if not networks:
        raise RequestError("no network given", location=Location(field))
    return networks


def shown_key(value: str) -> str:
    """How a key argument appears in messages: a full key (``kl-<key_id>-<secret>``) as
    ``kl-<key_id>-...`` only, so a secret is never echoed; an id or a name as is."""
    if value.startswith(PREFIX):
        return f"{PREFIX}{value[len(PREFIX) :].split('-', 1)[0][:8]}-..."
    return value


_FULL_KEY = re.compile(re.escape(PREFIX) + r"[0-9a-f]{8}-[A-Za-z0-9_\-]+")


def masked(text: str) -> str:
    """``text`` with every full key in it shown as :func:`shown_key` shows it (for messages
    that quote a request path or body a client sent)."""
    return _FULL_KEY.sub(lambda match: shown_key(match.group(0)), text)


def revoke_key(store: StateStore, key_id_or_name: str) -> ApiKeyRecord:
    """Revoke by id, name or the full key itself; raises when no active key matches (the
    message shows a full key only by its prefix, :func:`shown_key`)."""
    active = [k for k in store.list_api_keys() if k.revoked is None]
    key_hash = hash_key(key_id_or_name) if key_id_or_name.startswith(PREFIX) else None
    match = [k for k in active if key_id_or_name in (k.key_id, k.name) or k.key_hash == key_hash]
    if not match:
        known = ", ".join(f"{k.key_id} ({k.name})" for k in active) or "none"
        raise RequestError(f"no active API key {shown_key(key_id_or_name)!r}; active keys: {known}")
    for k in match:
        store.revoke_api_key(k.key_id, time.time())
    return match[0]


def describe_key(record: ApiKeyRecord) -> dict[str, object]:
    """A key as ``apikey list`` and ``GET /api/v1/apikeys`` show it (never its hash)."""
    return {
        "key_id": record.key_id,
        "name": record.name,
        "created": record.created,
        "revoked": record.revoked,
        "priority": record.priority,
        "scope": record.scope,
        "rpm": record.rpm,
        "tpm": record.tpm,
        "allow_ips": record.allow_ips,
    }


def no_admin_warning(store: StateStore) -> str | None:
    """A warning when keys exist but none is an active ``admin`` key: then no key may use
    the admin API through the daemon (only ``kunlun-cli`` on ``KUNLUN_HOME`` can help)."""
    active = [k for k in store.list_api_keys() if k.revoked is None]
    if not active or any(k.scope == "admin" for k in active):
        return None
    return (
        "no active key has scope 'admin', so no key can use the admin API (/api/v1: "
        "workloads, models, keys) through the daemon; create one on the daemon's machine "
        "with `kunlun-cli apikey create NAME --scope admin`"
    )


@dataclass(frozen=True)
class ActiveKey:
    """What the daemon knows of an active key (never its secret)."""

    key_id: str
    name: str
    scope: str
    priority: str | None
    rpm: int | None
    tpm: int | None
    allow_ips: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None

    @classmethod
    def of(cls, record: ApiKeyRecord) -> ActiveKey:
        networks = None
        if record.allow_ips is not None:
            networks = tuple(ipaddress.ip_network(n, strict=False) for n in record.allow_ips)
        return cls(record.key_id, record.name, record.scope, record.priority, record.rpm,
                   record.tpm, networks)  # fmt: skip


FIXED_KEY_MIN_CHARS = 8
"""The shortest key :meth:`KeyRing.add_fixed` accepts."""


FAILED_KEYS_PER_MINUTE = 10
"""Wrong API keys one client address may present per minute (at the API and the dashboard's
login together) before its wrong keys are answered 429 until the minute has passed. A valid
key always passes (no client locks out the others behind its address); loopback is not
counted (the operator's own tools; behind a local proxy, name it with
``--forwarded-allow-ips`` and the clients' own addresses count)."""
_FAILURE_ADDRESSES = 10_000
"""Addresses whose failures are remembered at once (the oldest are forgotten first)."""


class FailedKeys:
    """Wrong keys per client address over the last minute: guessing is throttled, and a
    flood of addresses costs bounded memory."""

    def __init__(self, per_minute: int = FAILED_KEYS_PER_MINUTE) -> None:
        self.per_minute = per_minute
        self._lock = threading.Lock()
        self._seen: dict[str, list[float]] = {}

    def _recent(self, address: str, now: float) -> list[float]:
        times = [t for t in self._seen.get(address, ()) if now - t < 60]
        if times:
            self._seen[address] = times
        else:
            self._seen.pop(address, None)
        return times

    def retry_after(self, address: str | None) -> int | None:
        """Seconds ``address`` must wait before presenting a key again, or None."""
        if _loopback(address):
            return None
        now = time.monotonic()
        with self._lock:
            times = self._recent(address or "", now)
            if len(times) < self.per_minute:
                return None
            return max(1, int(60 - (now - times[0])) + 1)

    def failed(self, address: str | None) -> None:
        if _loopback(address):
            return
        now = time.monotonic()
        with self._lock:
            times = self._recent(address or "", now)
            self._seen.pop(address or "", None)  # re-inserted last: the newest
            self._seen[address or ""] = [*times, now]
            while len(self._seen) > _FAILURE_ADDRESSES:
                self._seen.pop(next(iter(self._seen)))


def _loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class KeyRing:
    """The active keys by hash, refreshed when the store changes; ``failures`` throttles
    wrong keys per client address."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self.failures = FailedKeys()
        self._lock = threading.Lock()
        self._keys: dict[str, ActiveKey] = {}
        self._fixed: dict[str, ActiveKey] = {}
        self._version: object = object()
        self._checked = 0.0
        self.refresh(force=True)

    def add_fixed(self, secret: str, source: str) -> None:
        """Accept ``secret`` as an ``admin`` key with no limits besides the stored ones, for
        this run only (not stored; ``source`` names where it came from, e.g. the environment
        variable). For containers and CI that set one key from outside."""
        if len(secret) < FIXED_KEY_MIN_CHARS or secret != secret.strip():
            raise ConfigError(
                f"the API key given by {source} is too short or has surrounding spaces "
                f"({len(secret)} characters; at least {FIXED_KEY_MIN_CHARS} are needed)",
                location=Location(source),
            )
        key = ActiveKey("fixed", source, "admin", None, None, None, None)
        with self._lock:
            self._fixed = {hash_key(secret): key}
            self._keys = {**self._keys, **self._fixed}

    def refresh(self, force: bool = False, throttled: bool = True) -> None:
        """Re-read the keys if the store changed (asked at most every 0.25 s, unless not
        ``throttled``); ``force``: re-read them whatever the store's version says."""
        now = time.monotonic()
        if not force and throttled and now - self._checked < 0.25:
            return
        self._checked = now
        version = getattr(self._store, "data_version", lambda: None)()
        if not force and version is not None and version == self._version:
            return
        try:
            records = self._store.list_api_keys()
        except ClusterUnavailable:
            return  # a cluster's etcd without quorum: the keys known stay in force, retried later
        active = {k.key_hash: ActiveKey.of(k) for k in records if k.revoked is None}
        with self._lock:
            self._keys, self._version = {**active, **self._fixed}, version

    @property
    def enabled(self) -> bool:
        """Whether any active key exists (then every protected route needs one)."""
        self.refresh()
        return bool(self._keys)

    def lookup(self, secret: str | None) -> ActiveKey | None:
        """The active key ``secret`` is, or None; compared in constant time with every one."""
        self.refresh()
        if not secret:
            return None
        digest = hash_key(secret)
        found = self._find(digest)
        if found is None:  # made a moment ago (the CLI on disk)? Ask the store now, not later
            self.refresh(throttled=False)
            found = self._find(digest)
        return found

    def _find(self, digest: str) -> ActiveKey | None:
        """The active key whose hash is ``digest``, compared in constant time with every one."""
        found = None
        for key_hash, key in self._keys.items():
            if hmac.compare_digest(digest, key_hash):
                found = key
        return found

    def verify(self, secret: str | None) -> bool:
        """Whether ``secret`` is an active key."""
        return self.lookup(secret) is not None
