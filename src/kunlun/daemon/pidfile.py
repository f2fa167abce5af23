"""The running daemon's pid file under ``KUNLUN_HOME``: written by the daemon at start, read
by the CLI to find the daemon's address. A module of its own, so that reading it costs the
CLI no import of the daemon."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PID_FILE = "kunlun-platform.json"


def pid_info(home: Path) -> dict[str, Any] | None:
    """The running daemon's pid file, if that process is alive."""
    path = home / PID_FILE
    try:
        info = json.loads(path.read_text())
        started = _create_time(int(info["pid"]))
        if started is not None and abs(started - float(info["create_time"])) < 1.0:
            return info
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _create_time(pid: int) -> float | None:
    """When process ``pid`` started (Unix seconds, as psutil's ``create_time``), or None when
    there is no such process. Read from ``/proc`` where there is one: psutil's import is a
    tenth of a CLI command's start-up, and this is all the CLI needs of it."""
    if not Path("/proc/self/stat").exists():
        import psutil

        try:
            return float(psutil.Process(pid).create_time())
        except psutil.Error:
            return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
    with open("/proc/stat") as lines:
        boot = next(int(line.split()[1]) for line in lines if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")
