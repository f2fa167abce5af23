"""Dashboard sessions over a real key ring and state store: a cookie is signed, expires,
ends with its key or at logout, and the daemon's signing secret is private."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from kunlun.state.api_keys import KeyRing, create_key, revoke_key
from kunlun.state.sqlite import SQLiteStore
from kunlun.ui.session import SECRET_FILE, Sessions


def test_cookie_is_signed_expires_and_ends_with_its_key(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    ring = KeyRing(store)
    assert not ring.enabled
    sessions = Sessions(tmp_path, ring)
    open_cookie = sessions.open(None, "no keys", "admin")
    assert sessions.get(open_cookie) is not None  # no keys: the open daemon lets in
    record, secret = create_key(store, "ops", None, "admin")
    ring.refresh(force=True)
    assert sessions.get(open_cookie) is None  # a key now exists: log in with one
    cookie = sessions.open(secret, "ops", "admin")
    session = sessions.get(cookie)
    assert session is not None and session.admin and secret not in cookie
    sid, expires, signature = cookie.split(".")
    assert 8 * 3600 - 5 < int(expires) - time.time() <= 8 * 3600
    for forged in (f"{sid}.{int(expires) + 3600}.{signature}", f"{sid}.{expires}.{'0' * 64}",
                   f"{sid}.{expires}", "", "a.b.c"):  # fmt: skip
        assert sessions.get(forged) is None, forged
    again = Sessions(tmp_path, ring)  # same secret file, but sessions live in memory only
    assert again.get(cookie) is None
    short = Sessions(tmp_path, ring, lifetime_s=-1)
    assert short.get(short.open(secret, "ops", "admin")) is None  # expired
    sessions.close(cookie)
    assert sessions.get(cookie) is None
    cookie = sessions.open(secret, "ops", "admin")
    revoke_key(store, "ops")
    ring.refresh(force=True)
    assert sessions.get(cookie) is None  # revoking the key ends its sessions
    assert stat.S_IMODE(os.stat(tmp_path / SECRET_FILE).st_mode) == 0o600
    store.close()
