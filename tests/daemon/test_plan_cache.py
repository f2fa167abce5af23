"""The plan cache with a real daemon and the tiny model: a dry run starts nothing; the second
start of a workload is a hit that converts nothing; a changed device declaration is a miss."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil
from tests import loopback
from tests.daemons import TINY_SPEC, Daemon, Daemons, Profile, wait_ready

from kunlun.engine.launch import read_launch

BF16 = "dtype: bf16\n"  # the tiny model is stored in fp32: bf16 needs a conversion


def logs(daemon: Daemon, job: str) -> str:
    """What ``kunlun-cli workload logs JOB`` prints, read from the API (no CLI start-up)."""
    text, offset = "", 0
    while True:
        chunk = daemon.get(f"/api/v1/workloads/{job}/logs", params={"offset": offset}).json()
        if chunk["offset"] == offset:
            return text
        text, offset = text + chunk["text"], chunk["offset"]


def workload(daemon: Daemon, job: str) -> dict[str, Any]:
    """``kunlun-cli workload describe JOB --json``, from the API."""
    answer = daemon.get(f"/api/v1/workloads/{job}")
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def stop(daemon: Daemon, job: str) -> None:
    assert loopback.post(f"{daemon.url}/api/v1/workloads/{job}/stop", timeout=60).status_code == 200
    deadline = time.monotonic() + 60
    while daemon.get("/readyz").status_code == 200:
        assert time.monotonic() < deadline, "replica still ready after stop"
        time.sleep(0.2)


def test_plan_cache_hit_reuses_conversion_and_a_changed_declaration_misses(
    tiny_model: Path, daemons: Daemons
) -> None:
    spec = TINY_SPEC.format(path=tiny_model, name="tiny")  # a plan names a path's folder
    with daemons.serve(Profile("plan-cache-home")) as daemon:
        home = daemon.home
        dry = daemon.cli("workload", "submit", "--model", str(tiny_model), "--name", "tiny",
                         "--dtype", "bf16", "--dry-run")  # fmt: skip
        assert dry.returncode == 0, dry.stderr
        assert "would run" in dry.stdout and "target_device cpu:0" in dry.stdout
        assert (
            "why: cpu:0 (bf16, tp=1)" in dry.stdout
            and f"plan: {tiny_model.name} on cpu:0" in dry.stdout
        )
        listed = daemon.get("/api/v1/workloads").json()
        assert listed == [] and not (home / "plan-cache").exists()

        first = daemon.submit(spec + BF16 + "stream_interval: 2\n")
        wait_ready(daemon)
        text = logs(daemon, first)
        assert "plan_cache: miss" in text and "conversion: cast" in text
        assert f"plan: {tiny_model.name} on cpu:0: engine kunlun, dtype bf16" in text
        (artifact,) = home.glob("plan-cache/*/weights/model.safetensors")
        written = artifact.stat()
        # the plan's launch sits next to it; the worker runs the replica's copy and nothing else
        launch = read_launch(artifact.parent.parent / "launch.json")
        assert (launch.dtype, launch.device, launch.device_type) == ("bf16", "cpu", "cpu")
        assert launch.plan_dir == artifact.parent.parent and launch.sandbox is None
        # the plan's step budget and the spec's stream interval reach the worker
        plan = json.loads((artifact.parent.parent / "plan.json").read_text())
        assert launch.max_num_batched_tokens == plan["max_num_batched_tokens"] >= 1
        assert launch.stream_interval == 2
        (replica_launch,) = home.glob("run/workers/*.launch.json")
        started = read_launch(replica_launch)
        assert started.ready_file is not None and started.sandbox is not None
        assert started.access_key and launch.access_key is None  # this start's key only
        unique = {"ready_file": None, "sandbox": None, "access_key": None}
        assert started.model_copy(update=unique) == launch
        (pid,) = (json.loads(p.read_text())["pid"] for p in home.glob("run/workers/*.pid"))
        assert psutil.Process(pid).cmdline()[-2:] == ["--launch", str(replica_launch)]
        # started through its adapter's command, logged like an external engine's
        (line,) = [x for x in text.splitlines() if x.startswith("engine: ")]
        assert line.split()[-3:] == ["kunlun.serving.worker", "--launch", str(replica_launch)]
        described = workload(daemon, first)
        assert described["target_device"] == "cpu:0" and described["placement"]["why"]
        assert described["placement"]["plan"]["dtype"] == "bf16"
        stop(daemon, first)

        second = daemon.submit(spec + BF16)
        wait_ready(daemon)
        text = logs(daemon, second)
        assert "plan_cache: hit" in text and "conversion: reused" in text
        assert "conversion: cast" not in text
        assert (artifact.stat().st_mtime_ns, artifact.stat().st_ino) == (
            written.st_mtime_ns,
            written.st_ino,
        )
        describe = daemon.cli("workload", "describe", second)
        assert "target_device: cpu:0" in describe.stdout and "why: cpu:0" in describe.stdout
        assert daemon.stop() == 0

        config = home / "device-plugin-config.yaml"
        config.write_text(
            "devices:\n  - device_type: cpu\n    device_id: 0\n"
            "    custom_attributes: {num_threads: 2}\n"
        )
        daemon.start("--config", str(config), wait_ready=False)
        wait_ready(daemon)  # the daemon resumes the workload under the new declaration
        text = logs(daemon, second)
        after_restart = text[text.rindex("plan_cache:") :]  # this start's lines
        assert after_restart.startswith("plan_cache: miss") and "conversion: cast" in after_restart
        plan = workload(daemon, second)["placement"]["plan"]
        assert plan["engine_options"] == {"num_threads": 2}
