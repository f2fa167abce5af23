"""The request log: background batched writes, rotation, write errors, and a real daemon
whose queued entries all reach the file when SIGTERM stops it."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.daemons import Daemon, Daemons, Profile, refused

from kunlun.daemon.request_log import RequestLog, RequestLogConfig


def entry(n: int) -> dict[str, Any]:
    return {
        "ts": 1.0,
        "request_id": f"r{n}",
        "method": "POST",
        "path": "/v1/completions",
        "model": "m",
        "status": 200,
        "latency_ms": 1.5,
    }


def ids_in(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["request_id"] for line in path.read_text().splitlines()]


def wait_until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_entries_wait_in_memory_and_close_writes_them_all(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "requests.jsonl"
    log = RequestLog(path, RequestLogConfig(flush_interval_s=60))
    for n in range(100):
        log.write(entry(n))
    time.sleep(0.2)
    assert not path.exists()  # queued: nothing written on the caller's thread
    log.close()
    assert ids_in(path) == [f"r{n}" for n in range(100)]
    assert (log.num_written, log.num_dropped) == (100, 0)
    log.write(entry(100))  # after close: written at once
    assert ids_in(path)[-1] == "r100"


def test_the_writer_thread_flushes_on_its_interval_and_when_many_wait(tmp_path: Path) -> None:
    timed = RequestLog(tmp_path / "timed.jsonl", RequestLogConfig(flush_interval_s=0.1))
    timed.write(entry(1))
    wait_until(lambda: ids_in(timed.path) == ["r1"])
    timed.write(entry(2))
    wait_until(lambda: ids_in(timed.path) == ["r1", "r2"])  # appended to the same file
    timed.close()

    eager = RequestLog(
        tmp_path / "eager.jsonl", RequestLogConfig(flush_interval_s=60, flush_at_entries=10)
    )
    for n in range(9):
        eager.write(entry(n))
    time.sleep(0.2)
    assert not eager.path.exists()
    eager.write(entry(9))  # the tenth wakes the writer long before its interval
    wait_until(lambda: len(ids_in(eager.path)) == 10)
    eager.close()


def test_rotation_keeps_n_backups_each_under_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    line_size = len(json.dumps(entry(100)).encode()) + 1
    config = RequestLogConfig(max_bytes=10 * line_size, num_backups=2, flush_interval_s=60)
    log = RequestLog(path, config)
    for n in range(100, 135):  # 35 lines: 3.5 files' worth
        log.write(entry(n))
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["requests.jsonl", "requests.jsonl.1", "requests.jsonl.2"]
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= config.max_bytes
    kept = ids_in(tmp_path / "requests.jsonl.2") + ids_in(tmp_path / "requests.jsonl.1")
    kept += ids_in(path)
    assert kept == [f"r{n}" for n in range(110, 135)]  # the oldest 10 rotated away, in order

    again = RequestLog(path, config)  # a restart appends to the current file, then rotates
    for n in range(135, 141):
        again.write(entry(n))
    again.close()
    assert ids_in(tmp_path / "requests.jsonl.2") == [f"r{n}" for n in range(120, 130)]
    assert ids_in(tmp_path / "requests.jsonl.1") == [f"r{n}" for n in range(130, 140)]
    assert ids_in(path) == ["r140"]


def test_a_full_disk_is_reported_once_and_writing_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = tmp_path / "full.jsonl"
    full.symlink_to("/dev/full")  # every write: ENOSPC
    log = RequestLog(full, RequestLogConfig(flush_interval_s=0.05))
    for n in range(3):
        log.write(entry(n))
        wait_until(lambda n=n: log.num_dropped == n + 1)
    log.close()
    err = capsys.readouterr().err
    assert err.count("request log: cannot write") == 1
    assert f"{full}: [Errno 28]" in err and "serving continues" in err
    assert log.num_written == 0


def test_a_broken_path_recovers_once_it_can_be_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "logs"
    blocker.write_text("a file where the log folder should be")
    log = RequestLog(blocker / "requests.jsonl", RequestLogConfig(flush_interval_s=0.05))
    log.write(entry(1))
    wait_until(lambda: log.num_dropped == 1)
    assert "[Errno" in capsys.readouterr().err
    blocker.unlink()
    log.write(entry(2))
    wait_until(lambda: log.num_written == 1)
    log.close()
    assert ids_in(blocker / "requests.jsonl") == ["r2"]
    assert "writing" in capsys.readouterr().err


def test_no_entry_stops_the_writer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path, RequestLogConfig(flush_interval_s=0.05))
    log.write({**entry(1), "model": "\ud800"})  # a lone surrogate: UTF-8 cannot encode it
    log.write({**entry(2), "model": object()})  # JSON cannot hold this at all
    log.write(entry(3))
    wait_until(lambda: log.num_written == 2)  # by the writer thread, which is still alive
    for n in range(4, 8):
        log.write({**entry(n), "model": "\udc80" if n % 2 else object()})
    log.write(entry(8))
    wait_until(lambda: ids_in(path)[-1:] == ["r8"])
    log.close()
    lines = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert [e["request_id"] for e in lines] == ["r1", "r3", "r5", "r7", "r8"]
    assert lines[0]["model"] == "\ud800"  # written as its escape, read back the same
    assert (log.num_written, log.num_dropped, log.num_unwritable) == (5, 3, 3)
    err = capsys.readouterr().err
    assert err.count("request log: an entry cannot be written") == 1
    assert "later entries are written" in err


def test_sigterm_writes_every_queued_entry(daemons: Daemons) -> None:
    """A real daemon (no model: the /v1 requests need none) with a flush interval far longer
    than the test: every entry is still queued when SIGTERM arrives, and all are on disk
    once the daemon has exited."""
    with daemons.serve(Profile("request-log-home", args=("--request-log-flush-s", "60"))) as daemon:
        sigterm_writes_every_queued_entry(daemon)


def sigterm_writes_every_queued_entry(daemon: Daemon) -> None:
    num_requests = 120
    with httpx.Client(base_url=daemon.url, timeout=30) as client:
        for n in range(num_requests):
            headers = {"X-Request-Id": f"sigterm-{n}"}
            if n % 2:
                resp = client.get("/v1/models", headers=headers)
                assert resp.status_code == 200
            else:
                body = {"model": "nope", "prompt": "x"}
                resp = client.post("/v1/completions", json=body, headers=headers)
                assert resp.status_code == 404
    path = daemon.home / "logs" / "requests.jsonl"
    assert not path.exists()  # all still in memory
    daemon.signal(signal.SIGTERM)
    assert daemon.proc is not None and daemon.proc.wait(60) == 0, daemon.log()
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["request_id"] for e in entries] == [f"sigterm-{n}" for n in range(num_requests)]
    assert {e["status"] for e in entries[1::2]} == {200} and {
        e["status"] for e in entries[::2]
    } == {404}
    assert {e["model"] for e in entries[::2]} == {"nope"}


def test_bad_request_log_settings_are_refused_by_name(tmp_path: Path) -> None:
    for args, extra, named in (
        (["--request-log-max-mb", "0"], {}, "'--request-log-max-mb'"),
        ([], {"KUNLUN_REQUEST_LOG_BACKUPS": "-1"}, "'KUNLUN_REQUEST_LOG_BACKUPS'"),
    ):
        proc = refused(tmp_path, *args, env={"COLUMNS": "200", **extra})
        assert proc.returncode == 2, proc.stderr
        assert named in proc.stderr and "greater than or equal to" in proc.stderr
