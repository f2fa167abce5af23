"""A batch job never fails on what its answers hold, and a job that does fail (a broken
gateway) leaves no unregistered file behind. Real files, journals and SQLite store; the
gateway is a ``send`` function."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

from kunlun.batch.files import FileStore
from kunlun.batch.jobs import BatchJobs
from kunlun.batch.sending import Reply
from kunlun.state.sqlite import SQLiteStore


def line(custom_id: str) -> bytes:
    body = {"model": "m", "prompt": "hi"}
    record = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    return json.dumps(record).encode() + b"\n"


def run_batch(tmp_path: Path, num_lines: int, send: Any) -> tuple[FileStore, Any]:
    files = FileStore(tmp_path / "files", SQLiteStore(tmp_path / "state.db"))
    source = files.upload(
        io.BytesIO(b"".join(line(f"c{i}") for i in range(num_lines))), "in.jsonl", "batch"
    )

    async def run() -> Any:
        jobs = BatchJobs(files.store, files, send, concurrency=1)
        await jobs.start()
        record = jobs.create(source.file_id, "/v1/completions", "24h")
        for _ in range(600):
            if record.status in ("completed", "failed"):
                break
            await asyncio.sleep(0.05)
        await jobs.close()
        return record

    return files, asyncio.run(run())


def test_answers_json_cannot_hold_or_parse_are_written_and_the_job_completes(
    tmp_path: Path,
) -> None:
    bodies = iter([b'{"text": "\\ud800"}', b"[" * 5000 + b"]" * 5000, b'{"text": "ok"}'])

    async def send(path: str, body: bytes, request_id: str) -> Reply:
        return Reply(200, {}, next(bodies))

    files, record = run_batch(tmp_path, 3, send)
    assert record.status == "completed", record.errors
    lines = [json.loads(raw) for raw in files.path(record.output_file_id).read_bytes().splitlines()]
    answers = {entry["custom_id"]: entry["response"]["body"] for entry in lines}
    assert answers["c0"] == {"text": "\ud800"}  # written as its escape, read back the same
    assert answers["c1"].startswith("[[[")  # too deep to parse: kept as text
    assert answers["c2"] == {"text": "ok"}


def test_a_job_failing_inside_keeps_what_it_wrote_and_leaves_no_stray_file(
    tmp_path: Path,
) -> None:
    calls = 0

    async def send(path: str, body: bytes, request_id: str) -> Reply:
        nonlocal calls
        calls += 1
        if calls == 1:
            return Reply(200, {}, b'{"text": "first"}')
        return Reply(200, None, b"{}")  # type: ignore[arg-type]  # a broken gateway

    files, record = run_batch(tmp_path, 3, send)
    assert record.status == "failed"
    assert record.errors[0]["code"] == "internal_error"
    assert record.error_file_id is None  # it was empty: removed
    output = files.get(record.output_file_id)  # registered: the answered line can be read
    assert output.bytes > 0 and b"first" in files.path(output.file_id).read_bytes()
    on_disk = {p.name for p in files.root.iterdir()}
    registered = {r.file_id for r in files.store.list_files()}
    assert on_disk == registered


def test_a_reloading_model_is_waited_out_with_growing_waits(tmp_path: Path) -> None:
    """Issue 32: while a model reloaded, each line asked again every 1.5 s (1,615 503s in
    the request log). "Not now" answers are still waited out for as long as the job lives,
    but each wait of a line grows (about 1, 2, 4 s ...), never below ``Retry-After``."""
    import time

    started = time.monotonic()
    times: list[float] = []

    async def send(path: str, body: bytes, request_id: str) -> Reply:
        times.append(time.monotonic() - started)
        if times[-1] < 6.0:  # the model is loading for 6 s
            return Reply(503, {"retry-after": "1"}, b'{"error": {"message": "loading"}}')
        return Reply(200, {}, b'{"text": "ok"}')

    _, record = run_batch(tmp_path, 1, send)
    assert record.status == "completed", record.errors
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(gap >= 0.95 for gap in gaps), gaps  # Retry-After: 1 is honoured
    assert len(times) <= 5, times  # waiting 1 s each time would have asked 7 times
    assert gaps[-1] > gaps[0], gaps
