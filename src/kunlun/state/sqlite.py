"""SQLite implementation of the state store (one node; WAL mode; one connection, locked)."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kunlun.errors import Location, StateError
from kunlun.paths import FILE_MODE
from kunlun.state.store import (
    ApiKeyRecord,
    BatchRecord,
    EndpointRecord,
    EventRecord,
    FileRecord,
    ModelRecord,
    ResponseRecord,
    RolloutRecord,
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
CREATE TABLE IF NOT EXISTS rollouts (
  rollout_id TEXT PRIMARY KEY, created REAL NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS endpoints (name TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS responses (
  response_id TEXT PRIMARY KEY, created REAL NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS responses_by_created ON responses(created);
"""


class SQLiteStore(StateStore):
    """State in one SQLite file (``KUNLUN_HOME/state.db``)."""

    def __init__(self, path: str | Path) -> None:
        """Open the store at ``path``, creating it when (and only when) the file is absent.

        A file that is present but empty, not an SQLite database, damaged (``PRAGMA
        quick_check``) or without Kunlun's tables is never taken for a fresh install: it
        raises :class:`~kunlun.errors.StateError` naming the file, the problem and what to do.
        """
        self.path = Path(path)
        self._db = _open(self.path)
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

    def put_rollout(self, record: RolloutRecord) -> None:
        self._exec(
            "INSERT OR REPLACE INTO rollouts VALUES (?,?,?)",
            (record.rollout_id, record.created, json.dumps(asdict(record))),
        )

    def get_rollout(self, rollout_id: str) -> RolloutRecord | None:
        rows = self._exec("SELECT data FROM rollouts WHERE rollout_id = ?", (rollout_id,))
        return RolloutRecord(**json.loads(rows[0][0])) if rows else None

    def list_rollouts(self) -> list[RolloutRecord]:
        rows = self._exec("SELECT data FROM rollouts ORDER BY created, rowid")
        return [RolloutRecord(**json.loads(r[0])) for r in rows]

    def put_endpoint(self, record: EndpointRecord) -> None:
        self._exec(
            "INSERT OR REPLACE INTO endpoints VALUES (?,?)",
            (record.name, json.dumps(asdict(record))),
        )

    def get_endpoint(self, name: str) -> EndpointRecord | None:
        rows = self._exec("SELECT data FROM endpoints WHERE name = ?", (name,))
        return EndpointRecord(**json.loads(rows[0][0])) if rows else None

    def list_endpoints(self) -> list[EndpointRecord]:
        rows = self._exec("SELECT data FROM endpoints ORDER BY name")
        return [EndpointRecord(**json.loads(r[0])) for r in rows]

    def delete_endpoint(self, name: str) -> bool:
        with self._lock, self._db:
            return self._db.execute("DELETE FROM endpoints WHERE name = ?", (name,)).rowcount > 0

    def put_response(self, record: ResponseRecord) -> None:
        self._exec(
            "INSERT OR REPLACE INTO responses VALUES (?,?,?)",
            (record.response_id, record.created, json.dumps(asdict(record))),
        )

    def get_response(self, response_id: str) -> ResponseRecord | None:
        rows = self._exec("SELECT data FROM responses WHERE response_id = ?", (response_id,))
        return ResponseRecord(**json.loads(rows[0][0])) if rows else None

    def delete_response(self, response_id: str) -> bool:
        with self._lock, self._db:
            done = self._db.execute("DELETE FROM responses WHERE response_id = ?", (response_id,))
            return done.rowcount > 0

    def delete_responses_before(self, created: float) -> int:
        with self._lock, self._db:
            return self._db.execute("DELETE FROM responses WHERE created < ?", (created,)).rowcount

    def data_version(self) -> int:
        """Changes whenever another connection commits (cheap change detection)."""
        return int(self._exec("PRAGMA data_version")[0][0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


_KEY_COLUMNS = "key_id, name, key_hash, created, revoked, priority, scope, rpm, tpm, allow_ips"
#: Tables every state file has had since the first version: a file without them is not a
#: Kunlun state store (tables added later are created on open).
_CORE_TABLES = ("workloads", "events", "api_keys", "models")
_HEADER = b"SQLite format 3\x00"
_MAX_PROBLEMS = 3


def _open(path: Path) -> sqlite3.Connection:
    """A connection to the checked store at ``path`` (created when absent), in WAL mode."""
    if not path.exists():
        _create(path)
    _check_file(path)
    try:
        db = sqlite3.connect(path, check_same_thread=False, timeout=10)
        try:
            _check_contents(db, path)
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            _add_missing_columns(db)
        except BaseException:
            db.close()
            raise
    except sqlite3.DatabaseError as exc:
        raise _unusable(path, f"the database is damaged (SQLite: {exc})") from None
    return db


def _create(path: Path) -> None:
    """A new, empty store at ``path``: written aside and linked into place, so the file
    appears complete (schema and WAL mode) or not at all, and a store made meanwhile by
    another process is kept. A write-ahead log left without its database is refused: its
    frames would be replayed onto the new file."""
    wal = path.with_name(path.name + "-wal")
    if wal.exists() and wal.stat().st_size > 0:
        raise _unusable(
            path,
            f"the file is missing but its write-ahead log {wal.name} is present "
            "(the database was removed or moved while in use; to start empty, move "
            f"{wal.name} aside too)",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.new")
    staging.unlink(missing_ok=True)
    try:
        db = sqlite3.connect(staging)
        try:
            db.executescript(_SCHEMA)
            db.execute("PRAGMA journal_mode=WAL")
        finally:
            db.close()
        staging.chmod(FILE_MODE)
        try:
            os.link(staging, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        except OSError:  # a file system without hard links: a rename, if still absent
            if not path.exists():
                os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def _check_file(path: Path) -> None:
    """Refuse a file that is empty or does not start with SQLite's header."""
    try:
        with path.open("rb") as handle:
            head = handle.read(len(_HEADER))
    except OSError as exc:
        raise _unusable(path, f"cannot read it ({exc.strerror})") from None
    if not head:
        raise _unusable(path, "the file is empty (0 bytes), so every key and workload is gone")
    if head != _HEADER:
        raise _unusable(path, f"not an SQLite database (it starts with {head[:8]!r})")


def _check_contents(db: sqlite3.Connection, path: Path) -> None:
    """Refuse a database whose pages are damaged or that lacks Kunlun's tables.

    ``PRAGMA quick_check`` reads every page (it skips only the index-content cross-check of
    ``integrity_check``): see ``benchmarks/state_open.py`` for its cost.
    """
    rows = [str(row[0]) for row in db.execute("PRAGMA quick_check").fetchall()]
    if rows != ["ok"]:
        more = f" and {len(rows) - _MAX_PROBLEMS} more" if len(rows) > _MAX_PROBLEMS else ""
        found = "; ".join(" ".join(r.split()) for r in rows[:_MAX_PROBLEMS])
        raise _unusable(path, f"the database is damaged: quick_check found {found}{more}")
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    missing = [table for table in _CORE_TABLES if table not in tables]
    if missing:
        raise _unusable(
            path,
            "an SQLite database but not Kunlun's state: it has no "
            + ", ".join(f"'{table}'" for table in missing)
            + " table",
        )


def _unusable(path: Path, problem: str) -> StateError:
    return StateError(
        f"state database cannot be used: {problem}",
        location=Location(str(path)),
        hint=f"restore {path.name} from a backup; or salvage what is left with "
        f"`sqlite3 {path} .recover | sqlite3 {path}.recovered` and move that into "
        "place; or move the file aside to start empty (every API key, workload and model "
        "alias is then forgotten, and with no key the API is open)",
    )


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
