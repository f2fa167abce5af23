"""Daemon lifecycle: SIGTERM drains (a SIGKILLed daemon's workers die with it and leftovers
are reaped on restart: tests/daemon/test_worker_sandbox.py)."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

from tests import loopback
from tests.daemons import TINY, Daemon, Daemons, Profile, free_port

from kunlun.daemon.pidfile import pid_info

STREAM_TOKENS = 400
"""Each stream's length (``ignore_eos``): with every engine step :data:`STEP_DELAY_MS` later,
at least 4 s however fast the machine, so all are still going when the daemon is told to stop
and its late request is refused (asserted)."""
STEP_DELAY_MS = 10
"""An injected slow device (``faults.step_delay_ms``): a stream's length no longer races the
test's own steps on a machine that decodes the tiny model fast."""


def stream(url: str, results: list[list[str]], started: threading.Event) -> None:
    body = {
        "model": "tiny",
        "prompt": "Count slowly:",
        "max_tokens": STREAM_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    lines: list[str] = []
    with loopback.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            lines.append(line)
            if len(lines) == 2:
                started.set()
    results.append(lines)


def test_the_port_takes_connections_only_once_the_pid_file_says_where(tmp_path: Path) -> None:
    """A script that waits for the daemon's port and then runs ``kunlun-cli`` finds the
    daemon: the CLI reads the address from the pid file, and the port takes connections only
    once it is written. (The port used to listen first, while the app was still being built,
    and an air-gap test's CLI call in that window went to the default port.)"""
    daemon = Daemon(tmp_path / "home", free_port())
    daemon.home.mkdir()
    daemon.proc = daemon._spawn((), None)
    deadline = time.monotonic() + 120
    try:
        while True:
            assert daemon.proc.poll() is None, daemon.log()
            try:
                socket.create_connection(("127.0.0.1", daemon.port), timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, daemon.log()
                time.sleep(0.001)
        found = pid_info(daemon.home)  # at once: what the CLI reads
        assert found is not None and found["port"] == daemon.port, daemon.log()
        while loopback.get(daemon.url + "/healthz", timeout=60).status_code != 200:
            time.sleep(0.1)
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert pid_info(daemon.home) is None  # removed when it stops


def test_sigterm_drains_in_flight_streams(daemons: Daemons) -> None:
    slow = TINY + f"faults:\n  step_delay_ms: {STEP_DELAY_MS}\n"
    with daemons.serve(Profile("drain-home", (slow,))) as daemon:
        drains_in_flight_streams(daemon)


def drains_in_flight_streams(daemon: Daemon) -> None:
    results: list[list[str]] = []
    events = [threading.Event() for _ in range(4)]
    threads = [threading.Thread(target=stream, args=(daemon.url, results, e)) for e in events]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(60)
    daemon.signal(signal.SIGTERM)
    time.sleep(0.3)
    late = loopback.post(
        daemon.url + "/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert late.status_code == 503
    assert late.json()["error"]["code"] == "service_unavailable"
    assert daemon.get("/readyz").status_code == 503
    assert all(t.is_alive() for t in threads), "a stream ended before the late request"
    for t in threads:
        t.join(120)
    assert len(results) == 4
    for lines in results:
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in lines)
    assert daemon.proc is not None and daemon.proc.wait(60) == 0
    assert "draining" in daemon.log()
    assert not list((daemon.home / "run" / "workers").glob("*.pid"))  # workers stopped cleanly
