"""The processes that do not compute (the daemon, the CLI) start without torch.

A daemon starts in every test that serves and on every restart an operator does; torch's
import is about two seconds of two cores. Only the engine workers need it. Checked in a
fresh interpreter, since the test process may have torch loaded already.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["kunlun.daemon.app", "kunlun.daemon.main", "kunlun.cli.main"])
def test_module_imports_no_torch(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
