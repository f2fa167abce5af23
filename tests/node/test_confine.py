"""``python -m kunlun.node.confine``: an external engine's server is confined, then exec'd.

A real parent process starts a real program (``sleep``) through the prefix, as the node agent
starts llama-server; the test reads the program's niceness, rlimits and ``NoNewPrivs`` from
the kernel, then SIGKILLs the parent and sees the program die with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kunlun.node import confine

PARENT = """
import os, subprocess, sys, time
from kunlun.node import confine
from kunlun.sandbox import WorkerSandbox
child = subprocess.Popen(confine.command(WorkerSandbox(parent_pid=os.getpid()), 3,
                                         ["sleep", "600"]))
print(child.pid, flush=True)
time.sleep(600)
"""


def wait_for(check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_program_is_confined_and_dies_with_its_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        child = psutil.Process(pid)
        wait_for(lambda: child.name() == "sleep")  # the prefix exec'd it: the same pid
        assert child.ppid() == parent.pid
        assert child.nice() == os.nice(0) + 3
        assert child.rlimit(psutil.RLIMIT_CORE) == (0, 0)
        assert "NoNewPrivs:\t1" in Path(f"/proc/{pid}/status").read_text()
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE)
    finally:
        parent.kill()
        parent.wait(30)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--sandbox", "{not json", "--", "true"], "--sandbox: sandbox is not a WorkerSandbox"),
        (["--sandbox", '{"parent_pid": 1}', "--nice", "40", "--", "true"], "--nice must be 0-19"),
        (["--sandbox", '{"parent_pid": 1}', "--"], "no program after --"),
    ],
)
def test_bad_arguments_are_refused_naming_them(args: list[str], said: str) -> None:
    proc = subprocess.run([sys.executable, "-m", confine.MODULE, *args], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and said in proc.stderr


def test_a_missing_program_is_said_once() -> None:
    sandbox = f'{{"parent_pid": {os.getpid()}}}'
    proc = subprocess.run([sys.executable, "-m", confine.MODULE, "--sandbox", sandbox, "--",
                           "/nonexistent/llama-server"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 127
    assert proc.stderr.count("cannot start /nonexistent/llama-server") == 1
