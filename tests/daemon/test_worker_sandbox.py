"""Sandboxed engine workers, through the real daemon: a clean environment, their own
directory, rlimits, no_new_privs, seccomp; a forbidden call or a worker over its memory cap
fails the workload with the reason; workers die with their daemon."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from tests import loopback
from tests.daemons import TINY, TINY_SPEC, Daemon, Daemons, Profile

FOREIGN = {"ASCEND_RT_VISIBLE_DEVICES": "0", "MLU_VISIBLE_DEVICES": "0", "SECRET_TOKEN": "x"}


def workload(daemon: Daemon, job: str) -> dict[str, Any]:
    """What ``kunlun-cli workload describe JOB --json`` prints, straight from the API (the
    CLI's start-up would cost seconds per poll)."""
    answer = daemon.get(f"/api/v1/workloads/{job}")
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def worker_pid(daemon: Daemon, job: str, timeout: float = 120) -> int:
    """The pid of the workload's (first) worker once it has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replicas = workload(daemon, job)["replicas"]
        if replicas and replicas[0]["pid"]:
            return int(replicas[0]["pid"])
        time.sleep(0.2)
    pytest.fail(f"no worker started within {timeout}s:\n{daemon.log()}")


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_state(daemon: Daemon, job: str, state: str, timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        described = workload(daemon, job)
        if described["state"] == state:
            return described
        time.sleep(0.3)
    pytest.fail(f"{job} not {state} within {timeout}s: {workload(daemon, job)}\n{daemon.log()}")


@pytest.fixture(scope="module")
def tiny_spec(tiny_model: Path) -> str:
    """The tiny model as workload ``tiny`` (the sandbox does not care what it serves)."""
    return TINY_SPEC.format(path=tiny_model, name="tiny")


def test_sandboxed_worker_serves_and_dies_with_its_daemon(
    daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in FOREIGN.items():
        monkeypatch.setenv(name, value)
    with daemons.serve(Profile("sandbox-home", (TINY,))) as daemon:
        job = daemon.job
        assert job is not None
        pid = worker_pid(daemon, job)
        replica_id = workload(daemon, job)["replicas"][0]["replica_id"]

        env = environ(pid)
        assert not set(FOREIGN) & set(env), env  # no other vendor's variables, no secrets
        assert env["KUNLUN_HOME"] == str(daemon.home)
        assert env["OMP_NUM_THREADS"].isdigit()
        workdir = daemon.home / "run" / "workers" / replica_id
        assert Path(f"/proc/{pid}/cwd").resolve() == workdir.resolve()
        assert workdir.stat().st_mode & 0o777 == 0o700
        facts = status(pid)
        assert facts["NoNewPrivs"] == "1"
        assert facts["Seccomp"] == "2"  # a filter is installed
        assert psutil.Process(pid).rlimit(psutil.RLIMIT_CORE) == (0, 0)
        assert psutil.Process(pid).rlimit(psutil.RLIMIT_NOFILE)[0] <= 4096
        assert "worker sandbox: on" in daemon.log()

        # it still serves, streamed and not, under the filter
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        reply = loopback.post(daemon.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        with loopback.stream(
            "POST", daemon.url + "/v1/completions", json=dict(body, stream=True), timeout=120
        ) as resp:
            lines = [line for line in resp.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"

        assert daemon.proc is not None
        daemon.proc.kill()  # the daemon dies; its worker must not outlive it
        daemon.proc.wait()
        deadline = time.monotonic() + 60
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pid), f"worker {pid} outlived its SIGKILLed daemon"

        daemon.start()  # the workload comes back by itself
        described = daemon.describe(job)  # through the CLI once
        assert described["state"] == "RUNNING"
        assert any(e["kind"] == "resumed" for e in described["events"])
        assert daemon.stop() == 0


def test_forbidden_system_call_fails_the_workload_with_the_call(
    tiny_spec: str, daemons: Daemons
) -> None:
    self_test = Profile("seccomp-home", env=(("KUNLUN_WORKER_SELF_TEST", "forbidden-syscall"),))
    with daemons.serve(self_test) as daemon:
        job = daemon.submit(tiny_spec)
        described = wait_state(daemon, job, "FAILED")
        reason = described["reason"]
        assert "seccomp: forbidden system call" in reason, reason
        if os.access("/dev/kmsg", os.R_OK):  # the kernel's audit record names the call
            assert "(chroot)" in reason, reason
        assert not described["replicas"]  # not restarted: the same call would kill it again
        assert daemon.get("/healthz").status_code == 200  # the daemon runs on


def test_worker_over_its_memory_cap_fails_the_workload(tiny_spec: str, daemons: Daemons) -> None:
    with daemons.serve(Profile("memcap-home")) as daemon:
        job = daemon.submit(tiny_spec + "memory_cap_mb: 64\n")
        described = wait_state(daemon, job, "FAILED")
        assert "worker exceeded its memory cap of 64 MiB" in described["reason"]
        proc = daemon.cli("workload", "describe", job)
        assert proc.returncode == 0, proc.stderr
        assert "worker exceeded its memory cap of 64 MiB" in proc.stdout
        assert daemon.get("/healthz").status_code == 200


def test_no_worker_sandbox_is_logged_and_keeps_only_the_death_signal(
    tiny_spec: str, daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "x")
    with daemons.serve(Profile("nosandbox-home", args=("--no-worker-sandbox",))) as daemon:
        job = daemon.submit(tiny_spec)
        pid = worker_pid(daemon, job)
        assert daemon.log().count("worker sandbox: OFF") == 1
        assert environ(pid)["SECRET_TOKEN"] == "x"  # the daemon's environment, as asked
        assert status(pid)["Seccomp"] == "0"


def test_restart_reaps_a_leftover_worker(daemons: Daemons) -> None:
    """A worker recorded by an earlier daemon that is still alive (one that could not be
    told to die with it) is killed when the next daemon starts."""
    reap = Profile("reap-home")
    home = daemons.home(reap)
    started = subprocess.run(  # orphaned at once, as a dead daemon's worker is
        ["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    leftover = psutil.Process(int(started.stdout))
    run_dir = home / "run" / "workers"
    run_dir.mkdir(parents=True)
    record = {"pid": leftover.pid, "create_time": leftover.create_time()}
    (run_dir / "wl-old-r0.pid").write_text(json.dumps(record))
    with daemons.serve(reap, home) as daemon:
        deadline = time.monotonic() + 60
        while not gone(leftover.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(leftover.pid)
        assert f"reaped 1 engine worker(s) left by an earlier daemon: [{leftover.pid}]" in (
            daemon.log()
        )
        assert not (run_dir / "wl-old-r0.pid").exists()
