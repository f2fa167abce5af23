"""Files of the OpenAI Batch API: uploaded request files and the files a batch writes.

The bytes live under ``KUNLUN_HOME/files/<file_id>``, the records in the state store. An
upload with purpose ``batch`` is checked line by line before it is accepted: each line is
``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}`` with unique ``custom_id`` values; a bad file is refused with the line and field
of each problem (a 400), so a batch never starts on input it cannot run. Lines are read with
:func:`kunlun.json_text.loads`: nesting deeper than its limit, or text UTF-8 cannot hold (a
lone surrogate in ``custom_id`` or the body), is such a problem.

A file may expire (OpenAI's ``expires_after``: anchor ``created_at``, 3600 to 2592000
seconds; a batch's ``output_expires_after`` for the files it writes). From that moment it is
gone for the API (404, not listed, not usable as a batch input); :meth:`FileStore.sweep`
removes its bytes and record, except while an unfinished batch still reads it. Without an
expiry a file stays until it is deleted.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kunlun import json_text
from kunlun.batch.inputs import CHAT_COMPLETIONS, COMPLETIONS
from kunlun.errors import Location, RequestError
from kunlun.state.store import FileRecord, StateStore

SUPPORTED_URLS = (CHAT_COMPLETIONS, COMPLETIONS)
MAX_UPLOAD_BYTES = 200 << 20
"""OpenAI's limit for a batch input file."""
MAX_PROBLEMS = 20
"""At most this many problems are listed when a file is refused."""
EXPIRY_RANGE_S = (3600, 2_592_000)
"""OpenAI's bounds for ``expires_after.seconds``: one hour to 30 days."""


def expiry_seconds(anchor: object, seconds: object, field: str) -> int:
    """The seconds of an ``expires_after`` policy (``field`` names it in errors), checked."""
    if anchor != "created_at":
        raise RequestError(
            f"'{field}.anchor' must be 'created_at', got {anchor!r}",
            location=Location("request", field=f"{field}.anchor"),
        )
    low, high = EXPIRY_RANGE_S
    try:
        value = int(str(seconds))
    except ValueError:
        value = -1
    if not low <= value <= high:
        raise RequestError(
            f"'{field}.seconds' must be an integer from {low} to {high}, got {seconds!r}",
            location=Location("request", field=f"{field}.seconds"),
        )
    return value


class NotFound(RequestError):
    """No file or batch has the id the request names."""

    code = "not_found"
    http_status = 404
    openai_type = "invalid_request_error"


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch input file."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_line(raw: bytes, number: int, source: str) -> BatchLine:
    """One input line, or a :class:`RequestError` naming ``source:line`` and the field."""

    def bad(message: str, field: str | None = None) -> RequestError:
        return RequestError(message, location=Location(source, number, field))

    data = json_text.loads(raw, source, number)  # bounded nesting, UTF-8 text
    if not isinstance(data, dict):
        raise bad(f"a line must be a JSON object, got {type(data).__name__}")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise bad(f"'custom_id' must be a non-empty string, got {custom_id!r}", "custom_id")
    if data.get("method") != "POST":
        raise bad(f"'method' must be 'POST', got {data.get('method')!r}", "method")
    if data.get("url") not in SUPPORTED_URLS:
        raise bad(
            f"'url' must be one of {', '.join(SUPPORTED_URLS)}, got {data.get('url')!r}", "url"
        )
    body = data.get("body")
    if not isinstance(body, dict):
        raise bad("'body' must be a JSON object (the request body)", "body")
    if not isinstance(body.get("model"), str):
        raise bad("'body.model' must name the model", "body.model")
    if body.get("stream"):
        raise bad("'body.stream' is not supported in a batch", "body.stream")
    return BatchLine(number, custom_id, data["url"], body)


def iter_lines(path: Path) -> Iterator[BatchLine]:
    """The requests of an accepted input file, in order (blank lines skipped)."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if raw.strip():
                yield parse_line(raw, number, path.name)


class FileInUse(RequestError):
    """A file an unfinished batch still reads cannot be deleted."""

    code = "file_in_use"
    http_status = 409
    openai_type = "invalid_request_error"


class FileStore:
    """Stored files: :meth:`upload` and :meth:`register` add, :meth:`get`, :meth:`path` and
    :meth:`page` read, :meth:`delete` and :meth:`sweep` remove."""

    def __init__(
        self, root: Path, store: StateStore, clock: Callable[[], float] = time.time
    ) -> None:
        self.root = root
        self.store = store
        self.clock = clock

    def expired(self, record: FileRecord) -> bool:
        return record.expires_at is not None and record.expires_at <= self.clock()

    @staticmethod
    def new_id() -> str:
        return "file-" + secrets.token_hex(12)

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    def get(self, file_id: str) -> FileRecord:
        record = self.store.get_file(file_id)
        if record is None or not self.path(file_id).exists():
            raise NotFound(
                f"no file with id {file_id!r}", location=Location("request", field="file_id")
            )
        if self.expired(record):
            raise NotFound(
                f"file {file_id!r} expired at {record.expires_at}",
                location=Location("request", field="file_id"),
            )
        return record

    def page(
        self,
        limit: int,
        after: str | None = None,
        purpose: str | None = None,
        newest_first: bool = True,
    ) -> list[FileRecord]:
        """At most ``limit`` files in ``created_at`` order, those after the file ``after``
        (the last id of the previous page; an unknown id gives an empty page)."""
        records = [
            r
            for r in self.store.list_files()
            if (purpose is None or r.purpose == purpose) and not self.expired(r)
        ]
        if newest_first:
            records.reverse()
        if after is not None:
            ids = [r.file_id for r in records]
            records = records[ids.index(after) + 1 :] if after in ids else []
        return records[:limit]

    def delete(self, file_id: str, used_by: list[str]) -> None:
        """Remove a file's record and bytes; refused while ``used_by`` (the ids of the
        unfinished batches that read it) is not empty."""
        self.get(file_id)
        if used_by:
            raise FileInUse(
                f"file {file_id!r} is the input of batch {', '.join(used_by)}, which has not "
                "finished",
                location=Location("request", field="file_id"),
                hint="wait for the batch to end, or cancel it, then delete the file",
            )
        self._remove(file_id)

    def _remove(self, file_id: str) -> None:
        self.store.delete_file(file_id)  # first: a crash leaves stray bytes, not a dead record
        self.path(file_id).unlink(missing_ok=True)

    def sweep(self, in_use: set[str]) -> list[str]:
        """Remove the expired files except those in ``in_use`` (read by unfinished batches);
        the ids removed. Blocking: run it in a thread."""
        gone = []
        for record in self.store.list_files():
            if self.expired(record) and record.file_id not in in_use:
                self._remove(record.file_id)
                gone.append(record.file_id)
        return gone

    def upload(
        self, source: IO[bytes], filename: str, purpose: str, expires_after_s: int | None = None
    ) -> FileRecord:
        """Store an upload (blocking: run it in a thread). Purpose ``batch`` only."""
        if purpose != "batch":
            raise RequestError(
                f"purpose {purpose!r} is not supported here; use 'batch'",
                location=Location("request", field="purpose"),
            )
        self.root.mkdir(parents=True, exist_ok=True)
        file_id = self.new_id()
        part = self.root / f"{file_id}.part"
        try:
            size = _copy(source, part)
            _check_batch_file(part, filename)
            os.replace(part, self.path(file_id))
        finally:
            part.unlink(missing_ok=True)
        return self._record(file_id, filename, purpose, size, expires_after_s)

    def register(
        self, file_id: str, filename: str, purpose: str, expires_after_s: int | None = None
    ) -> FileRecord:
        """Record a file already written at :meth:`path` (a batch's output or errors)."""
        size = self.path(file_id).stat().st_size
        return self._record(file_id, filename, purpose, size, expires_after_s)

    def _record(
        self, file_id: str, filename: str, purpose: str, size: int, expires_after_s: int | None
    ) -> FileRecord:
        now = int(self.clock())
        expires = None if expires_after_s is None else now + expires_after_s
        record = FileRecord(file_id, filename, purpose, size, now, expires)
        self.store.put_file(record)
        return record


def file_object(record: FileRecord) -> dict[str, Any]:
    """The OpenAI ``file`` object."""
    return {
        "id": record.file_id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "expires_at": record.expires_at,
        "status_details": None,
    }


def _copy(source: IO[bytes], target: Path) -> int:
    size = 0
    with target.open("wb") as out:
        while chunk := source.read(1 << 20):
            size += len(chunk)
            if size > MAX_UPLOAD_BYTES:
                raise RequestError(
                    f"the file is larger than {MAX_UPLOAD_BYTES >> 20} MiB",
                    location=Location("request", field="file"),
                )
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return size


def _check_batch_file(path: Path, filename: str) -> None:
    """Refuse a batch input file with bad lines or repeated ``custom_id`` values, listing each."""
    problems: list[RequestError] = []
    first: dict[str, int] = {}
    num_lines = 0
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                line = parse_line(raw, number, filename)
            except RequestError as exc:
                problems.append(exc)
                continue
            num_lines += 1
            if line.custom_id in first:
                problems.append(
                    RequestError(
                        f"custom_id {line.custom_id!r} repeats line {first[line.custom_id]}",
                        location=Location(filename, number, "custom_id"),
                    )
                )
            first.setdefault(line.custom_id, number)
    if not problems and num_lines == 0:
        problems.append(RequestError("the file holds no requests", location=Location(filename)))
    if problems:
        shown = "; ".join(str(p) for p in problems[:MAX_PROBLEMS])
        more = f" (and {len(problems) - MAX_PROBLEMS} more)" if len(problems) > MAX_PROBLEMS else ""
        raise RequestError(
            f"{len(problems)} problem(s) in the batch input file: {shown}{more}",
            location=Location("request", field="file"),
        )
