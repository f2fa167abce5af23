"""One real daemon for the rollout tests, serving the demo model as ``chat`` on cpu:0."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.daemon.conftest import Daemon, free_port, models_home, new_home, patient_queue

__all__ = ["models_home"]  # a fixture used here

SPEC = """\
model: smollm2
name: chat
batch_size: 4
max_model_len: 512
kv_cache_memory_mb: 32
"""


@pytest.fixture(scope="module")
def platform(models_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose workload ``chat`` (the demo model) is RUNNING."""
    home = patient_queue(new_home(models_home, tmp_path_factory, "rollout-home"))
    daemon = Daemon(home, free_port())
    daemon.start(wait_ready=False)
    try:
        submit_chat(daemon)
        yield daemon
    finally:
        daemon.stop()


def submit_chat(daemon: Daemon) -> str:
    spec = daemon.home / "chat.yaml"
    spec.write_text(SPEC)
    proc = daemon.cli("workload", "submit", "--file", str(spec), "--json")
    assert proc.returncode == 0, proc.stderr
    workload_id = str(json.loads(proc.stdout)["workload_id"])
    wait_serving(daemon, workload_id)
    return workload_id


def wait_serving(daemon: Daemon, workload_id: str, timeout_s: float = 600) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        described = daemon.describe(workload_id)
        if described["state"] == "RUNNING":
            return
        assert described["state"] not in ("FAILED", "STOPPED"), described
        time.sleep(0.5)
    raise AssertionError(f"{workload_id} not RUNNING within {timeout_s} s")
