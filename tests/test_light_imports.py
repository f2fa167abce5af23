"""The processes that do not compute (the daemon, the CLI) start without torch or numpy,
and a single node's daemon without the cluster's modules (etcd client, certificates).

A daemon starts in every test that serves and on every restart an operator does; torch's
import is about two seconds of two cores, numpy's 0.1-0.2 s, the cluster's about as much
(and the suite makes hundreds of CLI calls). Only the engine workers need torch and numpy,
only a cluster node its modules (imported where ``--cluster-etcd`` is handled). Checked in a
fresh interpreter, since the test process may have them loaded already.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["kunlun.daemon.app", "kunlun.daemon.main", "kunlun.cli.main"])
@pytest.mark.parametrize("heavy", ["torch", "numpy", "kunlun.cluster"])
def test_module_imports_no_torch_numpy_or_cluster(module: str, heavy: str) -> None:
    code = (
        f"import sys, {module}; "
        f"assert {heavy!r} not in sys.modules, "
        f"sorted(m for m in sys.modules if m.startswith({heavy!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
