"""The ``kunlun-installer`` command (:mod:`kunlun.offline.bootstrap`, standard library only,
so the same code runs from the offline bundle before anything is installed)."""

from __future__ import annotations

import sys

from kunlun.offline.bootstrap import main as _main
from kunlun.paths import private_umask


def main() -> None:
    private_umask()
    sys.exit(_main())
