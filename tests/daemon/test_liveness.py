"""A stopped engine worker (SIGSTOP) is noticed, taken out of routing and restarted; its
requests fail with 504 instead of hanging. Through the real daemon and worker processes,
serving the tiny model."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import psutil
from tests import loopback
from tests.daemons import TINY, Daemon, Daemons, Profile, stream_lines, wait_ready

DEADLINE_S = 3.0
"""The worker answer deadline the daemon runs with here (a test-sized value)."""
LONG = 2000
"""Tokens of the stream the stopped worker cuts: at the tiny model's speed it is still
running seconds after its first line, when the worker is stopped (the test asserts it
ended with the worker's error, not ``[DONE]``)."""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def worker_pid(daemon: Daemon, job: str) -> int:
    return int(daemon.describe(job)["replicas"][0]["pid"])


LIVENESS = Profile(
    "liveness-home",
    (TINY.replace("max_model_len: 1024", f"max_model_len: {LONG + 48}"),),
    args=("--worker-answer-deadline-s", str(DEADLINE_S)),
)


def test_a_stopped_worker_fails_its_requests_with_504_and_is_restarted(daemons: Daemons) -> None:
    with daemons.serve(LIVENESS) as daemon:
        job = daemon.job
        assert job is not None
        old_pid = worker_pid(daemon, job)
        lines: list[str] = []
        started = threading.Event()
        streaming = threading.Thread(
            target=stream_lines, args=(daemon.url, lines, started, LONG), kwargs={"model": "tiny"}
        )
        streaming.start()
        stopped: int | None = None
        try:
            assert started.wait(120), lines
            os.kill(old_pid, signal.SIGSTOP)
            stopped = old_pid
            answer = loopback.post(
                daemon.url + "/v1/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                timeout=120,  # generous: detection takes the answer deadline and a probe or two
            )
            assert answer.status_code in (503, 504), answer.text
            error = answer.json()["error"]
            if answer.status_code == 504:  # it reached the stopped worker before detection
                assert error["code"] == "worker_unresponsive"
                assert "answered no health probe" in error["message"]
            else:  # or it came just after: no replica ready
                assert error["code"] == "service_unavailable"
            streaming.join(120)
            assert not streaming.is_alive()
            assert lines[0] == "status 200"
            assert lines[-1] != "data: [DONE]"  # still running when its worker was stopped
            event = json.loads(lines[-1].removeprefix("data: "))
            assert event["error"]["code"] == "worker_unresponsive", lines[-1]
            assert sum('"error"' in line for line in lines) == 1
            # out of routing until a new worker is ready, then restarted and serving again
            deadline = time.monotonic() + 60
            while daemon.get("/readyz").status_code == 200:
                assert time.monotonic() < deadline, "the stopped replica stayed ready"
                time.sleep(0.05)
            deadline = time.monotonic() + 60
            while not gone(old_pid):
                assert time.monotonic() < deadline, "the stopped worker was not killed"
                time.sleep(0.1)
            stopped = None
        finally:
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, signal.SIGCONT)
            streaming.join(120)
        wait_ready(daemon)
        described = daemon.describe(job)
        assert described["replicas"][0]["pid"] != old_pid
        kinds = [e["kind"] for e in described["events"]]
        assert "unresponsive" in kinds and kinds.count("ready") >= 2, kinds
        why = next(e["message"] for e in described["events"] if e["kind"] == "unresponsive")
        assert f"(pid {old_pid}) is unresponsive" in why and "health probe" in why
        assert "is unresponsive" in (daemon.home / "logs" / f"{job}.log").read_text()
        again = loopback.post(
            daemon.url + "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
            timeout=120,
        )
        assert again.status_code == 200, again.text
