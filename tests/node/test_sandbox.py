"""The worker sandbox's parts, on real processes: the seccomp allow-list lets a process do
what serving needs and kills it for anything else; a worker whose daemon is already gone
exits at once; the environment holds only what the worker needs."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kunlun.device.registry import load_plugins
from kunlun.sandbox import WorkerSandbox, seccomp_available, worker_environment

needs_seccomp = pytest.mark.skipif(
    seccomp_available() is not None, reason=f"no seccomp here: {seccomp_available()}"
)


def run_locked(body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter after installing the worker's filter."""
    script = "from kunlun.syscalls import install_filter\ninstall_filter()\n"
    return subprocess.run(
        [sys.executable, "-c", script + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_seccomp
def test_filter_allows_threads_sockets_files_and_signals(tmp_path: Path) -> None:
    proc = run_locked(f"""
        import asyncio, os, signal, socket, threading
        out = []
        t = threading.Thread(target=lambda: out.append(sum(range(1000))))
        t.start(); t.join()
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        server.bind(("127.0.0.1", 0)); server.listen(1)
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept(); client.sendall(b"hi"); assert conn.recv(2) == b"hi"
        path = {str(tmp_path)!r} + "/f"
        with open(path + ".tmp", "w") as f: f.write("x")
        os.replace(path + ".tmp", path)
        signal.signal(signal.SIGUSR1, lambda *_: out.append("usr1"))
        os.kill(os.getpid(), signal.SIGUSR1)
        asyncio.run(asyncio.sleep(0.01))
        print(out)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[499500, 'usr1']"


@needs_seccomp
@pytest.mark.parametrize(
    "call",
    [
        "os.chroot('/')",
        "os.fork()",  # a new process, not a thread
        "os.execv('/bin/true', ['true'])",
        "socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)",
        "os.kill(os.getppid(), 0)",  # signalling another process, such as the daemon
        "os.setuid(0)",
    ],
)
def test_filter_kills_the_process_on_a_forbidden_call(call: str) -> None:
    proc = run_locked(f"import os, socket\nprint('locked', flush=True)\n{call}\nprint('survived')")
    assert proc.stdout.strip() == "locked"
    assert proc.returncode == -signal.SIGSYS


def test_worker_whose_daemon_is_gone_exits_at_once() -> None:
    script = (
        "from kunlun.sandbox import WorkerSandbox, enter\n"
        "enter(WorkerSandbox(parent_pid=1))\nprint('ran')"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout) == (0, "")


def test_sandbox_settings_cross_as_one_json_object() -> None:
    sandbox = WorkerSandbox(parent_pid=42, workdir="/w", memory_cap_mb=512, self_test=None)
    assert WorkerSandbox.from_json(sandbox.to_json()) == sandbox
    with pytest.raises(ValueError, match="sandbox is not a WorkerSandbox JSON object"):
        WorkerSandbox.from_json('{"parent_pid": 1, "shell": "sh"}')


def test_environment_holds_only_what_the_worker_needs(tmp_path: Path) -> None:
    daemon_env = {
        "PATH": "/opt/evil/bin:/usr/bin",
        "LANG": "en_US.UTF-8",
        "SECRET_TOKEN": "x",
        "ASCEND_RT_VISIBLE_DEVICES": "0",
        "MLU_VISIBLE_DEVICES": "0",
        "CUDA_HOME": "/usr/local/cuda",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
        "KUNLUN_API_KEY": "sk-secret",
        "KUNLUN_WORKER_NICE": "3",
    }
    cuda = load_plugins().plugins["nvidia"].runtime_env
    env = worker_environment(
        home=tmp_path,
        workdir=tmp_path / "w",
        device_env={"CUDA_VISIBLE_DEVICES": "1"},
        runtime_env=cuda,
        num_threads=2,
        source=daemon_env,
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["CUDA_HOME"] == "/usr/local/cuda"
    assert env["LD_LIBRARY_PATH"] == "/usr/local/cuda/lib64"
    assert env["KUNLUN_WORKER_NICE"] == "3"
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["HOME"] == env["TMPDIR"] == str(tmp_path / "w")
    assert "/opt/evil/bin" not in env["PATH"]
    for name in ("SECRET_TOKEN", "ASCEND_RT_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES",
                 "KUNLUN_API_KEY"):  # fmt: skip
        assert name not in env
    cpu = worker_environment(home=tmp_path, workdir=None, device_env={},
                             runtime_env=load_plugins().plugins["cpu"].runtime_env,
                             num_threads=1, source=daemon_env)  # fmt: skip
    assert "LD_LIBRARY_PATH" not in cpu and "CUDA_HOME" not in cpu


def test_no_plugin_passes_another_vendors_visibility_variable() -> None:
    plugins = load_plugins().plugins.values()
    visibility = {p.visibility_env for p in plugins if p.visibility_env}
    for plugin in plugins:
        assert not visibility & set(plugin.runtime_env), plugin.device_type
