"""API key records: scopes and limits round-trip the SQLite store; older stores migrate."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kunlun.errors import RequestError
from kunlun.state.api_keys import KeyRing, create_key, describe_key, no_admin_warning
from kunlun.state.sqlite import SQLiteStore

OLD_SCHEMA = """
CREATE TABLE workloads (
  workload_id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL,
  reason TEXT, target_device TEXT, placement TEXT NOT NULL, created REAL, updated REAL);
CREATE TABLE events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, workload_id TEXT NOT NULL, ts REAL NOT NULL,
  kind TEXT NOT NULL, message TEXT NOT NULL);
CREATE TABLE models (
  alias TEXT PRIMARY KEY, path TEXT NOT NULL, source TEXT NOT NULL, created REAL NOT NULL,
  meta TEXT NOT NULL);
CREATE TABLE api_keys (
  key_id TEXT PRIMARY KEY, name TEXT NOT NULL, key_hash TEXT NOT NULL, created REAL NOT NULL,
  revoked REAL);
INSERT INTO api_keys VALUES ('0badc0de', 'legacy', 'ab12', 1.0, NULL);
"""


def test_scope_and_limits_round_trip(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    record, secret = create_key(
        store, "app", "low", "inference", rpm=10, tpm=0, allow_ips="10.1.2.3, 2001:db8::/32"
    )
    assert record.allow_ips == ["10.1.2.3/32", "2001:db8::/32"]
    (stored,) = store.list_api_keys()
    assert describe_key(stored) == describe_key(record)
    assert describe_key(stored)["scope"] == "inference" and "key_hash" not in describe_key(stored)
    key = KeyRing(store).lookup(secret)
    assert key is not None and key.scope == "inference" and key.rpm == 10 and key.tpm == 0
    assert KeyRing(store).lookup(secret + "x") is None
    assert no_admin_warning(store) is not None and "--scope admin" in str(no_admin_warning(store))
    create_key(store, "ops", scope="admin")
    assert no_admin_warning(store) is None


def test_keys_from_before_scopes_become_admin(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SCHEMA)
    store = SQLiteStore(path)
    (legacy,) = store.list_api_keys()
    assert (legacy.name, legacy.scope, legacy.priority) == ("legacy", "admin", None)
    assert (legacy.rpm, legacy.tpm, legacy.allow_ips) == (None, None, None)
    record, _ = create_key(store, "new")  # a new key takes the default scope
    assert {k.name: k.scope for k in store.list_api_keys()} == {
        "legacy": "admin",
        "new": "inference",
    }
    assert record.scope == "inference"


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"scope": "root"}, "'root'"),
        ({"rpm": -1}, "--rpm"),
        ({"tpm": 2**40}, "--tpm"),
        ({"rpm": True}, "--rpm"),
        ({"allow_ips": "10.0.0.0/33"}, "'10.0.0.0/33'"),
        ({"allow_ips": "localhost"}, "'localhost'"),
        ({"allow_ips": ""}, "--allow-ip"),
    ],
)
def test_bad_scope_or_limit_is_refused_naming_it(
    tmp_path: Path, kwargs: dict[str, object], named: str
) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    with pytest.raises(RequestError) as caught:
        create_key(store, "x", **kwargs)  # type: ignore[arg-type]
    assert named in str(caught.value)
    assert store.list_api_keys() == []


def test_a_key_made_on_disk_is_known_at_once(tmp_path: Path) -> None:
    """The daemon asks its store at most every 0.25 s whether keys changed; a key another
    process (``kunlun-cli apikey create`` on the same host) stored a moment ago is looked up
    in the store at once instead of being refused until then."""
    ring = KeyRing(SQLiteStore(tmp_path / "state.db"))
    assert ring.lookup("kl-not-a-key") is None  # the ring has just asked the store
    _, secret = create_key(SQLiteStore(tmp_path / "state.db"), "temp")  # another connection
    assert ring.lookup(secret) is not None
    assert ring.lookup("kl-not-a-key") is None
