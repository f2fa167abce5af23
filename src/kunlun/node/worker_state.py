"""What the node agent keeps of each worker process, and what it reads off one.

:class:`Worker` is one supervised replica: what it runs (its engine adapter's command, and
the embedded engine's launch), its process, readiness, probes and restart state. The restart
rules' figures are here beside it: the backoff doubles from 1 s to :data:`MAX_BACKOFF_S`
and is reset after :data:`HEALTHY_RESET_S` of health, and a worker that dies
:data:`MAX_LOAD_FAILURES` times before it is ready is given up on. :func:`last_error` reads
the error a worker reported from the end of its log, :func:`thread_count` its threads from its
environment. Kept apart from :class:`~kunlun.node.agent.NodeAgent`, which acts on them.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kunlun.engine.launch import EngineLaunch, ReadyInfo
from kunlun.engines.adapter import EngineCommand
from kunlun.node.liveness import Liveness
from kunlun.sandbox import WorkerSandbox
from kunlun.serving.replica import Replica

MAX_BACKOFF_S = 60.0
HEALTHY_RESET_S = 60.0
MAX_LOAD_FAILURES = 5


@dataclass
class Worker:
    """One supervised worker process and its restart state."""

    replica: Replica
    command: EngineCommand
    """What the process runs, from its engine's adapter (:mod:`kunlun.engines`: the
    embedded engine, llama.cpp, vLLM, SGLang)."""
    launch: EngineLaunch | None
    """The embedded engine's launch, which the node agent completes with the ready file
    and sandbox and writes where the command reads it before each start; None for an
    external server (its settings are on its command line)."""
    env: dict[str, str]
    log_path: Path
    ready_file: Path
    sandbox: WorkerSandbox
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_at: float | None = None
    restarts: int = 0
    backoff_s: float = 1.0
    next_start: float | None = field(default_factory=time.monotonic)
    stopping: bool = False
    load_failures: int = 0
    """Consecutive exits before becoming ready (reset once ready)."""
    info: ReadyInfo | None = None
    """What it reported once ready (its ready file; an external server's check)."""
    liveness: Liveness | None = None
    """Probe history while ready (None otherwise)."""
    next_probe: float = 0.0
    probing: asyncio.Task[None] | None = None
    killed_for: str | None = None
    """Why the supervisor killed this process (it was unresponsive or stalled)."""
    checking: asyncio.Task[None] | None = None
    """An external engine's readiness check in flight."""

    @property
    def start_env(self) -> dict[str, str]:
        """Its process's environment: :attr:`env`, and an external server's key for this
        start where its engine takes one (:attr:`EngineCommand.key_env`)."""
        key_env, key = self.command.key_env, self.replica.worker_key
        return self.env if key_env is None or key is None else {**self.env, key_env: key}

    @property
    def asks_ready(self) -> bool:
        """Readiness is asked on the server's ready path; otherwise the process writes its
        ready file (the embedded engine's worker)."""
        return self.command.ready_path is not None


def thread_count(env: dict[str, str]) -> int:
    """The worker's ``OMP_NUM_THREADS`` (1 when absent or not a number)."""
    try:
        return max(1, int(env.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def last_error(log_path: Path) -> str | None:
    """The error a worker reported before exiting (its last ``error: ...`` line), if any."""
    try:
        with log_path.open("rb") as handle:
            handle.seek(max(0, log_path.stat().st_size - 8192))
            lines = handle.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("=== "):
            return None  # the start marker of this attempt: nothing reported since
        if line.startswith("error: "):
            return line.removeprefix("error: ").strip()
    return None
