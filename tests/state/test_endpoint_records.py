"""Endpoint records in the SQLite store: a state file from before endpoints existed gains
their table on open (nothing else changes), and records survive closing and reopening."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kunlun.state.sqlite import SQLiteStore
from kunlun.state.store import ApiKeyRecord, EndpointRecord

OLD_SCHEMA = """
CREATE TABLE workloads (workload_id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL,
  state TEXT NOT NULL, reason TEXT, target_device TEXT, placement TEXT NOT NULL, created REAL,
  updated REAL);
CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, workload_id TEXT NOT NULL,
  ts REAL NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL);
CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, name TEXT NOT NULL, key_hash TEXT NOT NULL,
  created REAL NOT NULL, revoked REAL);
CREATE TABLE models (alias TEXT PRIMARY KEY, path TEXT NOT NULL, source TEXT NOT NULL,
  created REAL NOT NULL, meta TEXT NOT NULL);
INSERT INTO api_keys VALUES ('k1', 'old', 'hash', 1.0, NULL);
"""
SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


def test_an_older_state_file_gains_endpoints_and_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.close()
    store = SQLiteStore(path)
    assert store.list_endpoints() == []
    assert [k.key_id for k in store.list_api_keys()] == ["k1"]  # the old rows are kept
    record = EndpointRecord("ask", "smollm2", SCHEMA, True, "Q: {{ input.q }}", "asks", 5.0, 5.0)
    store.put_endpoint(record)
    store.put_endpoint(EndpointRecord("a-first", "m", False, {}, "x"))
    store.close()
    store = SQLiteStore(path)
    assert store.get_endpoint("ask") == record
    assert [e.name for e in store.list_endpoints()] == ["a-first", "ask"]
    assert store.delete_endpoint("ask") is True and store.delete_endpoint("ask") is False
    assert isinstance(store.list_api_keys()[0], ApiKeyRecord)
    store.close()
