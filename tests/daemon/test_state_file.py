"""The state database is never taken for a fresh install unless it is absent.

A ``KUNLUN_HOME/state.db`` that is present but damaged (valid header, garbage pages), empty,
not a database, another program's database, or gone while its write-ahead log stays, stops
the real ``kunlun-platform`` with exit status 2 and one message on stderr naming the file,
the problem and what to do; ``kunlun-cli apikey ...`` on that home says the same. The file
is left as it was. Only an absent file is created, private (0600).
"""

from __future__ import annotations

import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.daemons import Daemon, free_port, refused

from kunlun.state.sqlite import SQLiteStore
from kunlun.state.store import ApiKeyRecord, EventRecord

PAGE = 4096


def real_store(path: Path) -> None:
    """A state database with a key and enough events to span about a hundred pages (few
    large events: each one is a transaction of its own)."""
    store = SQLiteStore(path)
    store.put_api_key(ApiKeyRecord("k1", "admin", "0" * 64, time.time()))
    for i in range(150):
        store.add_event(EventRecord(f"w{i % 20}", time.time(), "started", f"replica {i} " * 160))
    store.close()


def damaged(path: Path) -> None:
    """A real database whose header is intact and whose middle pages are garbage."""
    real_store(path)
    data = bytearray(path.read_bytes())
    num_pages = len(data) // PAGE
    assert num_pages > 20
    for page in range(num_pages // 2, num_pages // 2 + 4):
        data[page * PAGE : (page + 1) * PAGE] = bytes((i * 37 + page) % 251 for i in range(PAGE))
    path.write_bytes(bytes(data))
    assert path.read_bytes()[:16] == b"SQLite format 3\x00"


def empty(path: Path) -> None:
    real_store(path)
    path.write_bytes(b"")  # truncated to 0 bytes (a full disk, a bad copy)


def not_a_database(path: Path) -> None:
    path.write_text("workloads: []\n")


def another_programs_database(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (body TEXT)")
    db.commit()
    db.close()


def wal_without_database(path: Path) -> None:
    path.with_name("state.db-wal").write_bytes(b"\x37\x7f\x06\x82" + bytes(60))


CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("damaged_pages", damaged, "the database is damaged"),
    ("zero_bytes", empty, "the file is empty (0 bytes)"),
    ("not_a_database", not_a_database, "not an SQLite database"),
    ("another_programs_database", another_programs_database, "not Kunlun's state"),
    ("wal_without_database", wal_without_database, "write-ahead log state.db-wal is present"),
]


def one_clear_message(proc: subprocess.CompletedProcess[str], path: Path, problem: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    message = lines[0]
    assert message.startswith("error [state.unusable] ")
    assert f"{path}: state database cannot be used" in message and problem in message
    assert "restore state.db from a backup" in message and f"sqlite3 {path} .recover" in message


@pytest.mark.parametrize(
    ("make", "problem"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_unusable_state_db_stops_the_daemon_and_the_cli(
    tmp_path: Path, make: Callable[[Path], None], problem: str
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    path = home / "state.db"
    make(path)
    before = path.read_bytes() if path.exists() else None
    daemon = Daemon(home, free_port())
    one_clear_message(refused(home), path, problem)
    one_clear_message(daemon.cli("apikey", "create", "ops", remote=False), path, problem)
    after = path.read_bytes() if path.exists() else None
    assert after == before  # left as it was: nothing written over what can still be saved


def test_absent_state_db_is_a_fresh_install(tmp_path: Path) -> None:
    home = tmp_path / "home"
    daemon = Daemon(home, free_port())
    created = daemon.cli("apikey", "create", "ops", remote=False)
    assert created.returncode == 0, created.stderr
    path = home / "state.db"
    assert path.stat().st_mode & 0o777 == 0o600
    assert home.stat().st_mode & 0o777 == 0o700
    listed = daemon.cli("apikey", "list", "--json", remote=False)
    assert listed.returncode == 0 and '"name": "ops"' in listed.stdout
    assert not [p.name for p in home.iterdir() if p.name.startswith(".state.db")]
