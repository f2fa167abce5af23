"""The platform's own installed files, re-hashed against its wheel's ``RECORD``.

``kunlun-platform --require-signed`` does not start when they differ, and every integrity
sweep checks them again (:meth:`kunlun.offline.integrity.ModelGuard.check_platform`). Only
the files ``RECORD`` lists with a SHA-256 are checked: an editable (development) install
lists none of its source files, so nothing is checked there, which the daemon reports as not
checkable.
"""

from __future__ import annotations

import base64
import hashlib
from importlib import metadata
from pathlib import Path

PLATFORM_DIST = "kunlun-platform"


def record_problems(dist: str = PLATFORM_DIST) -> tuple[int, list[str]] | None:
    """The installed files of the distribution ``dist`` against the SHA-256 its ``RECORD``
    lists: how many were checked and one problem per file that is unreadable or differs;
    None when ``dist`` is not installed as a distribution."""
    try:
        found = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return None
    checked, problems = 0, []
    for entry in found.files or []:
        if entry.hash is None or entry.hash.mode != "sha256":
            continue
        path = Path(str(entry.locate()))
        try:
            digest = hashlib.file_digest(path.open("rb"), "sha256").digest()
        except OSError as exc:
            problems.append(f"{entry}: {exc.strerror or 'unreadable'}")
            continue
        checked += 1
        wanted = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4))
        if digest != wanted:
            problems.append(f"{entry}: content differs from the wheel's RECORD")
    return checked, problems
