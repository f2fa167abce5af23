"""API keys: created once and shown once, stored only as SHA-256 hashes, checked in constant time.

A key looks like ``kl-<key_id>-<secret>``. Once any active key exists, every route but
``/healthz`` and ``/readyz`` requires one. :class:`KeyRing` is the daemon's view: it re-reads
the store only when another process (``kunlun-cli apikey ...`` working on ``KUNLUN_HOME``
directly) has changed it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time

from kunlun.errors import Location, RequestError
from kunlun.state.store import ApiKeyRecord, StateStore

PREFIX = "kl-"


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


PRIORITIES = ("high", "normal", "low")


def create_key(
    store: StateStore, name: str, priority: str | None = None
) -> tuple[ApiKeyRecord, str]:
    """A new key; returns its record and the secret, which is never stored or shown again.
    ``priority`` (high, normal, low) sets the class of the key's requests (overriding the
    workload's; the ``X-Kunlun-Priority`` header overrides it in turn)."""
    name = name.strip()
    if not name or len(name) > 64:
        raise RequestError(f"key name must be 1-64 characters, got {name!r}")
    if priority is not None and priority not in PRIORITIES:
        raise RequestError(
            f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}",
            location=Location("--priority"),
        )
    key_id = secrets.token_hex(4)
    secret = f"{PREFIX}{key_id}-{secrets.token_urlsafe(24)}"
    record = ApiKeyRecord(
        key_id=key_id, name=name, key_hash=hash_key(secret), created=time.time(), priority=priority
    )
    store.put_api_key(record)
    return record, secret


def shown_key(value: str) -> str:
    """How a key argument appears in messages: a full key (``kl-<key_id>-<secret>``) as
    ``kl-<key_id>-...`` only, so a secret is never echoed; an id or a name as is."""
    if value.startswith(PREFIX):
        return f"{PREFIX}{value[len(PREFIX) :].split('-', 1)[0][:8]}-..."
    return value


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


class KeyRing:
    """The active key hashes, refreshed when the store changes."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._hashes: list[str] = []
        self._priorities: dict[str, str] = {}
        self._version: object = object()
        self._checked = 0.0
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        """Re-read the keys if the store changed (checked at most every 0.25 s)."""
        now = time.monotonic()
        if not force and now - self._checked < 0.25:
            return
        self._checked = now
        version = getattr(self._store, "data_version", lambda: None)()
        if not force and version is not None and version == self._version:
            return
        active = [k for k in self._store.list_api_keys() if k.revoked is None]
        hashes = [k.key_hash for k in active]
        priorities = {k.key_hash: k.priority for k in active if k.priority}
        with self._lock:
            self._hashes, self._priorities, self._version = hashes, priorities, version

    @property
    def enabled(self) -> bool:
        """Whether any active key exists (then every protected route needs one)."""
        self.refresh()
        return bool(self._hashes)

    def verify(self, secret: str | None) -> bool:
        """Constant-time check of ``secret`` against every active key."""
        self.refresh()
        if not secret:
            return False
        digest = hash_key(secret)
        ok = False
        for h in self._hashes:
            ok |= hmac.compare_digest(digest, h)
        return ok

    def priority(self, secret: str | None) -> str | None:
        """The priority class of a (verified) key, or None when it has none."""
        if not self._priorities or not secret:
            return None
        return self._priorities.get(hash_key(secret))
