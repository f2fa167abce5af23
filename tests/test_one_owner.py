"""Files that cannot import a fact's owner (a shell script, a systemd unit, the Makefile)
spell it as the owner says: the default port is :data:`kunlun.address.DEFAULT_PORT`."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kunlun.address import DEFAULT_PORT

ROOT = Path(__file__).resolve().parents[1]
SPELLED = {
    "deploy/kunlun-platform.service": r"--port (\d+)",
    "deploy/build-offline-image.sh": r"EXPOSE (\d+)",
}
"""File -> where it spells the daemon's port."""


def test_static_files_spell_the_default_port() -> None:
    for name, pattern in SPELLED.items():
        found = re.findall(pattern, (ROOT / name).read_text())
        assert found and set(found) == {str(DEFAULT_PORT)}, (name, found)


def test_make_run_serves_on_the_default_port() -> None:
    done = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert f"--port {DEFAULT_PORT}" in done.stdout, done.stdout + done.stderr
