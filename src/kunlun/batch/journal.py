"""An append-only JSON-lines file whose lines are durable once written, keyed by an id.

A batch writes each finished request as one line and fsyncs it before counting it
done, so a process killed at any moment leaves at most one torn line: the last, without
its newline or not valid JSON. :meth:`Journal.open` discards that line (truncating the file
to the last complete one) and returns the ids already recorded; the caller runs everything
else. Appending an id already present is refused, so each id appears exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

from kunlun.errors import KunlunError, Location
from kunlun.json_text import dumps_line


class JournalCorrupt(KunlunError):
    """A line other than the last is not a valid record: not a crash leftover, so it is not
    repaired silently."""

    code = "batch.journal_corrupt"


class Journal:
    """Durable JSON lines keyed by ``record[key]``; use :meth:`open`, then :meth:`append`."""

    def __init__(self, path: Path, key: str, ids: set[str], num_discarded: int) -> None:
        self.path = path
        self.key = key
        self.ids = ids
        """The ids recorded so far (as strings)."""
        self.num_discarded = num_discarded
        """1 when :meth:`open` discarded a torn last line, else 0."""
        self._file = path.open("ab")
        self._lock = asyncio.Lock()
        self._file_lock = threading.Lock()
        """Held by a write in its thread, so :meth:`close` waits for it (a cancelled
        :meth:`append` does not stop the thread it started)."""

    @classmethod
    def open(cls, path: Path, key: str) -> Journal:
        """Open (creating) the journal at ``path``, discarding a torn last line."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.touch()
            _fsync_dir(path.parent)
        ids, good_end, torn = _scan(path, key)
        if torn:
            with path.open("r+b") as handle:
                handle.truncate(good_end)
                handle.flush()
                os.fsync(handle.fileno())
        return cls(path, key, ids, int(torn))

    def records(self) -> list[dict[str, Any]]:
        """Every record in the file (read back from disk)."""
        with self.path.open("rb") as handle:
            return [json.loads(line) for line in handle if line.strip()]

    async def append(self, record: dict[str, Any]) -> bool:
        """Write ``record`` as one line and fsync it (in a thread, so the event loop keeps
        serving). False, and nothing written, when its id is already recorded."""
        record_id = str(record[self.key])
        data = dumps_line(record)  # any text encodes (a lone surrogate as its escape)
        async with self._lock:
            if record_id in self.ids:
                return False
            await asyncio.to_thread(self._write, data)
            self.ids.add(record_id)
        return True

    def close(self) -> None:
        with self._file_lock:
            self._file.close()

    def _write(self, data: bytes) -> None:
        with self._file_lock:
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())


def _scan(path: Path, key: str) -> tuple[set[str], int, bool]:
    """The ids in ``path``, the byte offset after the last good line, and whether the last
    line is torn. A bad line before the last raises :class:`JournalCorrupt`."""
    ids: set[str] = set()
    offset = good_end = 0
    with path.open("rb") as handle:
        lines = handle.readlines()
    for number, line in enumerate(lines, 1):
        offset += len(line)
        last = number == len(lines)
        record_id = _record_id(line, key) if line.endswith(b"\n") else None
        if record_id is None and line.strip():
            if last:
                return ids, good_end, True
            raise JournalCorrupt(
                f"line is not a JSON record with a {key!r} field",
                location=Location(str(path), number),
                hint="only a torn last line is repaired automatically; fix or remove this line",
            )
        if record_id is not None:
            ids.add(record_id)
        good_end = offset
    return ids, good_end, False


def _record_id(line: bytes, key: str) -> str | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get(key) is None:
        return None
    return str(record[key])


def _fsync_dir(path: Path) -> None:
    """Make a new directory entry durable (so a created file survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
