"""SQLite implementation of the state store (one node; WAL mode; one connection, locked)."""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kunlun.errors import ConfigError, Location
from kunlun.state.store import (
    ApiKeyRecord,
    BatchRecord,
    EventRecord,
    FileRecord,
    ModelRecord,
    StateStore,
    WorkloadRecord,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS workloads (
  workload_id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL,
  reason TEXT, target_device TEXT, placement TEXT NOT NULL, created REAL, updated REAL);
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY AUTOINCREMENT, workload_id TEXT NOT NULL, ts REAL NOT NULL,
  kind TEXT NOT NULL, message TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_workload ON events(workload_id, id);
CREATE TABLE IF NOT EXISTS api_keys (
  key_id TEXT PRIMARY KEY, name TEXT NOT NULL, key_hash TEXT NOT NULL, created REAL NOT NULL,
  revoked REAL, priority TEXT, scope TEXT NOT NULL DEFAULT 'inference', rpm INTEGER,
  tpm INTEGER, allow_ips TEXT);
CREATE TABLE IF NOT EXISTS models (
  alias TEXT PRIMARY KEY, path TEXT NOT NULL, source TEXT NOT NULL, created REAL NOT NULL,
  meta TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (file_id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
  batch_id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, data TEXT NOT NULL);
"""


class SQLiteStore(StateStore):
    """State in one SQLite file (``KUNLUN_HOME/state.db``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            _add_missing_columns(self._db)
        except sqlite3.DatabaseError as exc:
            raise ConfigError(
                f"cannot open the state store: {exc}",
                location=Location(str(self.path)),
                hint="move the file aside; Kunlun creates a new one",
            ) from exc
        self._lock = threading.Lock()

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock, self._db:
            return self._db.execute(sql, args).fetchall()

    # workloads
    def put_workload(self, record: WorkloadRecord) -> None:
        self._exec(
            "INSERT OR REPLACE INTO workloads VALUES (?,?,?,?,?,?,?,?,?)",
            (
                record.workload_id,
                record.name,
                json.dumps(record.spec),
                record.state,
                record.reason,
                record.target_device,
                json.dumps(record.placement),
                record.created,
                record.updated,
            ),
        )

    def get_workload(self, workload_id: str) -> WorkloadRecord | None:
        rows = self._exec("SELECT * FROM workloads WHERE workload_id = ?", (workload_id,))
        return _workload(rows[0]) if rows else None

    def list_workloads(self) -> list[WorkloadRecord]:
        return [_workload(r) for r in self._exec("SELECT * FROM workloads ORDER BY created")]

    # events
    def add_event(self, event: EventRecord) -> None:
        self._exec(
            "INSERT INTO events (workload_id, ts, kind, message) VALUES (?,?,?,?)",
            (event.workload_id, event.ts, event.kind, event.message),
        )

    def list_events(self, workload_id: str) -> list[EventRecord]:
        rows = self._exec(
            "SELECT workload_id, ts, kind, message FROM events WHERE workload_id = ? ORDER BY id",
            (workload_id,),
        )
        return [EventRecord(*r) for r in rows]

    # API keys
    def put_api_key(self, record: ApiKeyRecord) -> None:
        allow_ips = None if record.allow_ips is None else json.dumps(record.allow_ips)
        self._exec(
            f"INSERT OR REPLACE INTO api_keys ({_KEY_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                record.key_id,
                record.name,
                record.key_hash,
                record.created,
                record.revoked,
                record.priority,
                record.scope,
                record.rpm,
                record.tpm,
                allow_ips,
            ),
        )

    def list_api_keys(self) -> list[ApiKeyRecord]:
        rows = self._exec(f"SELECT {_KEY_COLUMNS} FROM api_keys ORDER BY created")
        return [_api_key(r) for r in rows]

    def revoke_api_key(self, key_id: str, when: float) -> bool:
        with self._lock, self._db:
            cur = self._db.execute(
                "UPDATE api_keys SET revoked = ? WHERE key_id = ? AND revoked IS NULL",
                (when, key_id),
            )
            return cur.rowcount == 1

    # models
    def put_model(self, record: ModelRecord) -> None:
        self._exec(
            "INSERT OR REPLACE INTO models VALUES (?,?,?,?,?)",
            (record.alias, record.path, record.source, record.created, json.dumps(record.meta)),
        )

    def get_model(self, alias: str) -> ModelRecord | None:
        rows = self._exec("SELECT * FROM models WHERE alias = ?", (alias,))
        return _model(rows[0]) if rows else None

    def list_models(self) -> list[ModelRecord]:
        return [_model(r) for r in self._exec("SELECT * FROM models ORDER BY alias")]

    # Batch API files and jobs (each record as one JSON document)
    def put_file(self, record: FileRecord) -> None:
        self._exec(
            "INSERT OR REPLACE INTO files VALUES (?,?)",
            (record.file_id, json.dumps(asdict(record))),
        )

    def get_file(self, file_id: str) -> FileRecord | None:
        rows = self._exec("SELECT data FROM files WHERE file_id = ?", (file_id,))
        return FileRecord(**json.loads(rows[0][0])) if rows else None

    def list_files(self) -> list[FileRecord]:
        rows = self._exec("SELECT data FROM files ORDER BY rowid")
        return [FileRecord(**json.loads(r[0])) for r in rows]

    def delete_file(self, file_id: str) -> bool:
        with self._lock, self._db:
            return self._db.execute("DELETE FROM files WHERE file_id = ?", (file_id,)).rowcount > 0

    def put_batch(self, record: BatchRecord) -> None:
        self._exec(
            "INSERT OR REPLACE INTO batches VALUES (?,?,?)",
            (record.batch_id, record.created_at, json.dumps(asdict(record))),
        )

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        rows = self._exec("SELECT data FROM batches WHERE batch_id = ?", (batch_id,))
        return BatchRecord(**json.loads(rows[0][0])) if rows else None

    def list_batches(self) -> list[BatchRecord]:
        rows = self._exec("SELECT data FROM batches ORDER BY created_at DESC, rowid DESC")
        return [BatchRecord(**json.loads(r[0])) for r in rows]

    def data_version(self) -> int:
        """Changes whenever another connection commits (cheap change detection)."""
        return int(self._exec("PRAGMA data_version")[0][0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


_KEY_COLUMNS = "key_id, name, key_hash, created, revoked, priority, scope, rpm, tpm, allow_ips"


def _add_missing_columns(db: sqlite3.Connection) -> None:
    """Bring a state file written by an older version up to the schema above.

    Keys made before scopes existed could do everything; they become ``admin`` keys, so an
    upgrade locks nobody out of the admin API (``kunlun-cli apikey list`` shows their scope;
    replace them with narrower keys at will). Their limits are the daemon's defaults."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(api_keys)")}
    with db:
        if "priority" not in columns:
            db.execute("ALTER TABLE api_keys ADD COLUMN priority TEXT")
        if "scope" not in columns:
            db.execute("ALTER TABLE api_keys ADD COLUMN scope TEXT NOT NULL DEFAULT 'admin'")
        for name in ("rpm", "tpm"):
            if name not in columns:
                db.execute(f"ALTER TABLE api_keys ADD COLUMN {name} INTEGER")
        if "allow_ips" not in columns:
            db.execute("ALTER TABLE api_keys ADD COLUMN allow_ips TEXT")


def _api_key(row: tuple[Any, ...]) -> ApiKeyRecord:
    key_id, name, key_hash, created, revoked, priority, scope, rpm, tpm, allow_ips = row
    return ApiKeyRecord(key_id, name, key_hash, created, revoked, priority, scope, rpm, tpm,
                        None if allow_ips is None else json.loads(allow_ips))  # fmt: skip


def _workload(row: tuple[Any, ...]) -> WorkloadRecord:
    wid, name, spec, state, reason, target, placement, created, updated = row
    return WorkloadRecord(
        wid, name, json.loads(spec), state, reason, target, json.loads(placement), created, updated
    )


def _model(row: tuple[Any, ...]) -> ModelRecord:
    alias, path, source, created, meta = row
    return ModelRecord(alias, path, source, created, json.loads(meta))
