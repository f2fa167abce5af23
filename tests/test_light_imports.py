"""The processes that do not compute (the daemon, the CLI) start without torch or numpy,
and a single node's daemon without the cluster's modules (etcd client, certificates); the
CLI imports only the command it runs (``--help`` none) and talks to the daemon over the
standard library's HTTP.

A daemon starts in every test that serves and on every restart an operator does; torch's
import is about two seconds of two cores, numpy's 0.1-0.2 s, the cluster's about as much
(and the suite makes hundreds of CLI calls). Only the engine workers need torch and numpy,
only a cluster node its modules (imported where ``--cluster-etcd`` is handled). Checked in a
fresh interpreter, since the test process may have them loaded already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def run_cli(*argv: str, env: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """``kunlun-cli argv`` in a fresh interpreter: (what it printed, the modules it loaded)."""
    code = (
        "import json, sys\n"
        f"sys.argv = ['kunlun-cli', *{list(argv)!r}]\n"
        "from kunlun.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('MODULES=' + json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    out, _, modules = done.stdout.rpartition("MODULES=")
    return out + done.stderr, json.loads(modules)


def test_help_lists_every_command_and_imports_none_of_them() -> None:
    from kunlun.cli.commands import COMMANDS

    out, modules = run_cli("--help")
    listed = " ".join(out.split())  # rich wraps the lines
    for name, entry in COMMANDS.items():
        assert f" {name} " in listed, name
        assert " ".join(entry.summary.split()[:4]) in listed, (name, entry.summary)
    loaded = {entry.module for entry in COMMANDS.values()} & set(modules)
    assert loaded <= {"kunlun.cli.main"}, loaded
    assert "httpx" not in modules and "kunlun.workload.spec" not in modules


def test_a_daemon_command_talks_http_without_an_http_client_library() -> None:
    env = dict(os.environ, KUNLUN_ENDPOINT="http://127.0.0.1:9")  # nothing listens there
    out, modules = run_cli("workload", "list", env=env)
    assert "cli.daemon_unreachable" in out and "127.0.0.1:9" in out, out
    assert "kunlun.cli.workload" in modules
    assert not {"httpx", "kunlun.cli.model", "kunlun.cli.validate"} & set(modules)


def test_the_pid_file_names_a_live_daemon_only_while_that_process_runs(tmp_path: Path) -> None:
    """The CLI reads the daemon's pid file without psutil (``/proc``): the process must be
    alive and started when the file says (a pid reused by another process is not it)."""
    import psutil

    from kunlun.daemon.pidfile import PID_FILE, pid_info

    me = psutil.Process()
    record = {"pid": me.pid, "create_time": me.create_time(), "host": "127.0.0.1", "port": 1}
    (tmp_path / PID_FILE).write_text(json.dumps(record))
    assert pid_info(tmp_path) == record
    (tmp_path / PID_FILE).write_text(json.dumps({**record, "create_time": me.create_time() - 5}))
    assert pid_info(tmp_path) is None  # the same pid, another process
    (tmp_path / PID_FILE).write_text(json.dumps({**record, "pid": 2**22 + 1}))
    assert pid_info(tmp_path) is None  # no such process
    code = (f"import sys; from pathlib import Path; from kunlun.daemon.pidfile import pid_info; "
            f"assert pid_info(Path({str(tmp_path)!r})) is None; assert 'psutil' not in sys.modules")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
