"""The audit log, ``KUNLUN_HOME/logs/audit.jsonl``: one JSON object per line (``ts``, ``event``
and the event's fields), appended.

Two writers share the file and its form. :func:`audit` is the installer's (``kunlun-installer``:
keys trusted and untrusted, a model's signer changed): one event per call, the file created
0600 in a 0700 folder, an error raised. :class:`AuditLog` is the daemon's
(:mod:`kunlun.offline.integrity`): thread-safe, and a write that fails is counted and printed,
never raised.

Standard library only: the installer's bootstrap imports it before anything is installed (it
is one of the modules of the installer zipapp, :data:`kunlun.offline.bundle.ZIPAPP_MODULES`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

AUDIT_FILE = "logs/audit.jsonl"
"""The audit log under ``KUNLUN_HOME``: what the installer decided about trust and what the
daemon checked, refused, sealed and stopped."""


def audit(home: Path, event: str, **fields: object) -> None:
    """Append one event to ``HOME/logs/audit.jsonl`` (the daemon's audit log, same form)."""
    path = home / AUDIT_FILE
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    line = json.dumps({"ts": round(time.time(), 3), "event": event, **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as handle:
        handle.write(line)


class AuditLog:
    """``KUNLUN_HOME/logs/audit.jsonl``: one JSON object per line, appended and flushed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.write_errors = 0

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ts": round(time.time(), 3), "event": event, **fields}) + "\n"
        with self._lock:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as handle:
                    handle.write(line)
            except OSError as exc:  # counted and reported once per failure, never raised
                self.write_errors += 1
                print(f"audit log {self.path}: cannot write ({exc.strerror}): {line}", flush=True)
