"""Health probes on a loaded host (``make test-soak``; marked ``soak``, left out of
``make test``: it loads the machine on purpose, for minutes).

With ``stress-ng --cpu 2`` holding every core, two idle replicas of the demo model, one
generating and one embedding, are probed every second for ``KUNLUN_SOAK_S`` seconds (300 by default): probes
answered late are slow, not failed, and neither replica is ever ejected. Then one is stopped
(SIGSTOP), still under load: it is ejected within the documented time
(``interval_s + timeout_s + min(1, timeout_s)``), as on a quiet host.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Any

import pytest
from tests.daemons import Daemon, Daemons, Profile

pytestmark = pytest.mark.soak

INTERVAL_S, TIMEOUT_S = 1.0, 0.5
SPECS = ("model: smollm2\nname: chat\nmax_num_seqs: 4\nmax_model_len: 1024\n",
         "model: smollm2\nname: embed\ntask: embed\nmax_model_len: 1024\n")  # fmt: skip
LOADED = Profile(
    "soak-home", SPECS, demo=True,
    args=("--health-check-interval", str(INTERVAL_S), "--health-check-timeout", str(TIMEOUT_S)),
)  # fmt: skip


def replicas(daemon: Daemon) -> dict[str, dict[str, Any]]:
    """Every replica by model, once each is ready."""
    deadline = time.monotonic() + 600
    while True:
        found = {}
        for job in daemon.get("/api/v1/workloads").json():
            described = daemon.get(f"/api/v1/workloads/{job['workload_id']}").json()
            for replica in described["replicas"]:
                if replica["ready"]:
                    found[described["name"]] = {**replica, "job": job["workload_id"]}
        if len(found) == 2:
            return found
        assert time.monotonic() < deadline, found
        time.sleep(0.5)


def events(daemon: Daemon, job: str) -> list[dict[str, Any]]:
    return list(daemon.get(f"/api/v1/workloads/{job}").json()["events"])


def test_idle_replicas_on_a_loaded_host_stay_in_routing(daemons: Daemons) -> None:
    stress = shutil.which("stress-ng")
    assert stress, "stress-ng is not installed (apt-get install stress-ng)"
    duration = float(os.environ.get("KUNLUN_SOAK_S", "300"))
    with daemons.serve(LOADED) as daemon:
        ready = replicas(daemon)
        load = subprocess.Popen([stress, "--cpu", "2", "--timeout", f"{int(duration) + 60}s"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        stopped = None
        try:
            time.sleep(duration)
            metrics = daemon.get("/metrics").text
            counts = {(m, r): float(n) for m, r, n in re.findall(
                r'kunlun_health_probes_total\{model="([\w-]+)",result="(\w+)"\} (\S+)',
                metrics)}  # fmt: skip
            print(f"probes over {duration:g} s under stress-ng --cpu 2: {counts}")
            for name, replica in ready.items():
                kinds = [e["kind"] for e in events(daemon, replica["job"])]
                assert "ejected" not in kinds, (name, events(daemon, replica["job"]))
                assert counts.get((name, "pass"), 0) + counts.get((name, "slow"), 0) >= (
                    duration / INTERVAL_S / 4
                ), counts  # probed all along
            target = ready["chat"]
            stopped_at = time.time()
            os.kill(target["pid"], signal.SIGSTOP)
            stopped = target["pid"]
            limit = INTERVAL_S + TIMEOUT_S + min(1.0, TIMEOUT_S) + 2.0  # + slack under load
            deadline = time.monotonic() + 60
            while not [e for e in events(daemon, target["job"])
                       if e["kind"] == "ejected" and e["ts"] >= stopped_at]:  # fmt: skip
                assert time.monotonic() < deadline, events(daemon, target["job"])
                time.sleep(0.1)
            ejected = next(e for e in events(daemon, target["job"]) if e["kind"] == "ejected")
            print(f"ejected {ejected['ts'] - stopped_at:.2f} s after SIGSTOP under load")
            assert ejected["ts"] - stopped_at <= limit, ejected
        finally:
            load.terminate()
            load.wait(30)
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, signal.SIGCONT)
