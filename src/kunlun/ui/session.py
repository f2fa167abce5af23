"""Dashboard sessions: a signed, expiring cookie standing for an API key.

Logging in with a key (:mod:`kunlun.ui.app`) opens a session: a random id kept in memory
with the key's secret, scope and name. The browser holds only ``id.expiry.signature``
(HMAC-SHA256 with a per-daemon secret in ``KUNLUN_HOME/ui-secret``, mode 0600), HttpOnly and
SameSite=Strict, so a script on the page cannot read it and another site cannot send it.
The key itself never leaves the daemon. Each request re-checks the key against the
daemon's key ring: revoking the key ends its sessions. A daemon restart ends them all.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kunlun.state.api_keys import KeyRing

COOKIE = "kunlun_ui"
LIFETIME_S = 8 * 3600
"""How long a session lasts after its login."""
SECRET_FILE = "ui-secret"


@dataclass(frozen=True)
class Session:
    """Who is logged in: the key's secret (None on a daemon without keys), name, scope."""

    key: str | None
    name: str
    scope: str
    expires: int

    @property
    def admin(self) -> bool:
        return self.scope == "admin"


def load_secret(home: Path) -> bytes:
    """The per-daemon signing secret, made on first use with 0600 permissions."""
    path = home / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        return path.read_bytes()
    value = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as handle:
        handle.write(value)
    return value


class Sessions:
    """The open sessions of one daemon and the cookie that names each."""

    def __init__(self, home: Path, keyring: KeyRing, lifetime_s: int = LIFETIME_S) -> None:
        self.keyring = keyring
        self.lifetime_s = lifetime_s
        self._secret = load_secret(home)
        self._open: dict[str, Session] = {}
        self._lock = threading.Lock()

    def _sign(self, text: str) -> str:
        return hmac.new(self._secret, text.encode(), hashlib.sha256).hexdigest()

    def open(self, key: str | None, name: str, scope: str) -> str:
        """A new session; returns the cookie value."""
        expires = int(time.time()) + self.lifetime_s
        sid = secrets.token_urlsafe(24)
        with self._lock:
            now = time.time()
            self._open = {k: s for k, s in self._open.items() if s.expires > now}
            self._open[sid] = Session(key, name, scope, expires)
        body = f"{sid}.{expires}"
        return f"{body}.{self._sign(body)}"

    def close(self, cookie: str | None) -> None:
        sid = (cookie or "").split(".", 1)[0]
        with self._lock:
            self._open.pop(sid, None)

    def get(self, cookie: str | None) -> Session | None:
        """The live session ``cookie`` names, or None (unsigned, altered, expired, ended,
        or its key revoked since)."""
        parts = (cookie or "").split(".")
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        sid, expires, signature = parts
        if not hmac.compare_digest(signature, self._sign(f"{sid}.{expires}")):
            return None
        with self._lock:
            session = self._open.get(sid)
        if session is None or session.expires != int(expires) or session.expires < time.time():
            return None
        if self.keyring.enabled:
            if session.key is None or self.keyring.lookup(session.key) is None:
                return None
        elif session.key is not None:
            return None  # the keys were all revoked: log in again to see the open daemon
        return session
