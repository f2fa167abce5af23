"""The running daemon's pid file under ``KUNLUN_HOME``: written by the daemon at start, read
by the CLI to find the daemon's address. A module of its own, so that reading it costs the
CLI no import of the daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PID_FILE = "kunlun-platform.json"


def pid_info(home: Path) -> dict[str, Any] | None:
    """The running daemon's pid file, if that process is alive."""
    path = home / PID_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    import psutil  # only where a pid file is there to check (the CLI's start-up)

    try:
        proc = psutil.Process(int(info["pid"]))
        if abs(proc.create_time() - float(info["create_time"])) < 1.0:
            return info
    except (ValueError, KeyError, TypeError, psutil.Error):
        pass
    return None
