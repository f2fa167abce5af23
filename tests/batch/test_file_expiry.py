"""File expiry: an expired file is gone for the API at once, and swept from disk and the state
store unless an unfinished batch still reads it. The clock is the store's own, advanced by
the test; the files and the SQLite state store are real."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from kunlun.batch.files import FileStore, NotFound, expiry_seconds, file_object
from kunlun.batch.jobs import BatchJobs
from kunlun.batch.sending import Reply
from kunlun.errors import RequestError
from kunlun.state.sqlite import SQLiteStore


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


LINE = json.dumps(
    {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "hi"},
    }
).encode()


def store_at(tmp_path: Path, clock: Clock) -> FileStore:
    return FileStore(tmp_path / "files", SQLiteStore(tmp_path / "state.db"), clock)


def test_an_expired_file_is_gone_for_the_api_then_swept(tmp_path: Path) -> None:
    clock = Clock()
    files = store_at(tmp_path, clock)
    short = files.upload(io.BytesIO(LINE), "short.jsonl", "batch", 3600)
    kept = files.upload(io.BytesIO(LINE), "kept.jsonl", "batch")
    assert short.expires_at == short.created_at + 3600
    assert file_object(short)["expires_at"] == short.expires_at
    assert kept.expires_at is None and file_object(kept)["expires_at"] is None

    clock.now += 3599
    assert files.get(short.file_id) == short
    assert files.sweep(set()) == []

    clock.now += 1  # the expiry moment itself
    with pytest.raises(NotFound, match=f"file '{short.file_id}' expired at {short.expires_at}"):
        files.get(short.file_id)
    assert [r.file_id for r in files.page(10)] == [kept.file_id]
    assert files.path(short.file_id).exists()  # not swept yet

    # an unfinished batch still reads it: kept on disk until the batch ends
    assert files.sweep({short.file_id}) == []
    assert files.path(short.file_id).exists()
    assert files.sweep(set()) == [short.file_id]
    assert not files.path(short.file_id).exists()
    assert files.store.get_file(short.file_id) is None
    assert files.get(kept.file_id) == kept  # no expiry: kept

    # the record survives a restart of the store, expiry included
    again = store_at(tmp_path, clock)
    assert again.store.get_file(kept.file_id) == kept


def test_registered_output_files_take_the_batch_policy(tmp_path: Path) -> None:
    clock = Clock()
    files = store_at(tmp_path, clock)
    files.root.mkdir(parents=True)
    files.path("file-out").write_bytes(b'{"custom_id": "a"}\n')
    record = files.register("file-out", "b_output.jsonl", "batch_output", 7200)
    assert (record.bytes, record.expires_at) == (19, int(clock.now) + 7200)


@pytest.mark.parametrize(
    ("anchor", "seconds", "field"),
    [
        ("last_active_at", 3600, "expires_after.anchor"),
        (None, 3600, "expires_after.anchor"),
        ("created_at", 3599, "expires_after.seconds"),
        ("created_at", 2_592_001, "expires_after.seconds"),
        ("created_at", "soon", "expires_after.seconds"),
        ("created_at", None, "expires_after.seconds"),
    ],
)
def test_bad_expiry_policies_name_the_field(anchor: object, seconds: object, field: str) -> None:
    with pytest.raises(RequestError) as caught:
        expiry_seconds(anchor, seconds, "expires_after")
    assert caught.value.location is not None and caught.value.location.field == field
    assert repr(seconds if field.endswith("seconds") else anchor) in str(caught.value)


def test_bounds_are_accepted() -> None:
    assert expiry_seconds("created_at", "3600", "x") == 3600  # a form field is a string
    assert expiry_seconds("created_at", 2_592_000, "x") == 2_592_000


def test_the_jobs_sweep_expired_files_while_they_run(tmp_path: Path) -> None:
    clock = Clock()
    files = store_at(tmp_path, clock)
    doomed = files.upload(io.BytesIO(LINE), "doomed.jsonl", "batch", 3600)
    clock.now += 3600

    async def never(path: str, body: bytes, request_id: str) -> Reply:
        raise AssertionError("no request is sent")

    async def run() -> None:
        jobs = BatchJobs(files.store, files, never, sweep_interval_s=0.05)
        await jobs.start()
        for _ in range(100):
            if not files.path(doomed.file_id).exists():
                break
            await asyncio.sleep(0.05)
        await jobs.close()

    asyncio.run(run())
    assert not files.path(doomed.file_id).exists()
    assert files.store.get_file(doomed.file_id) is None
