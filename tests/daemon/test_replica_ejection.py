"""Health checks through the real daemon serving the tiny model, its engine workers and the
``openai`` SDK: a stopped (SIGSTOP) replica leaves routing within two probe intervals while
the other replica answers every request, and is back within two more once continued
(SIGCONT); a replica whose full batch makes its probes wait stays in routing."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from tests.daemons import TINY, Daemon, Daemons, Profile, refused, stream_lines

INTERVAL_S = 2.0
"""The health-check interval the daemon runs with here (timeout 1 s)."""
SLACK_S = 1.5
"""For a loaded machine: the event loop, the probe's own answer, the event's write."""
QUESTION: Any = [{"role": "user", "content": "Say hi."}]


def workload(daemon: Daemon, job: str) -> dict[str, Any]:
    response = daemon.get(f"/api/v1/workloads/{job}")
    assert response.status_code == 200, response.text
    return dict(response.json())


def wait_for_event(daemon: Daemon, job: str, kind: str, after: float, timeout: float) -> dict:
    """The first ``kind`` event of ``job`` stamped after ``after`` (wall clock), polled every
    0.1 s for up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        events = workload(daemon, job)["events"]
        found = [e for e in events if e["kind"] == kind and e["ts"] >= after]
        if found:
            return dict(found[0])
        if time.monotonic() > deadline:
            pytest.fail(f"no {kind!r} event within {timeout} s: {events}")
        time.sleep(0.1)


def ejected_metric(daemon: Daemon, replica_id: str) -> float:
    text = daemon.get("/metrics").text
    pattern = rf'^kunlun_replica_ejected\{{[^}}]*replica="{re.escape(replica_id)}"[^}}]*\}} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    assert found, text
    return float(found.group(1))


def both_ready(daemon: Daemon, job: str, timeout: float = 600) -> list[dict[str, Any]]:
    """The workload's two replicas, once both are ready (generous: two workers load side by
    side on a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout
    while True:
        replicas = workload(daemon, job)["replicas"]
        if len(replicas) == 2 and all(r["ready"] for r in replicas):
            return list(replicas)
        if time.monotonic() > deadline:
            pytest.fail(f"two replicas not ready within {timeout} s: {replicas}\n{daemon.log()}")
        time.sleep(0.5)


def served_by(client: openai.OpenAI) -> str:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=QUESTION, max_tokens=2, temperature=0
    )
    assert raw.parse().choices
    return str(raw.headers["x-kunlun-replica"])


TWO_REPLICAS = Profile(
    "ejection-home", (TINY + "replicas: 2\n",),
    args=("--health-check-interval", str(INTERVAL_S), "--health-check-timeout", "1",
          "--worker-answer-deadline-s", "120"),  # the liveness kill stays out of it
    files=(("scheduler_config.yaml", "policy: round-robin\n"),),
)  # fmt: skip
BUSY = Profile(
    "busy-home", (TINY.replace("max_num_seqs: 8", "max_num_seqs: 2"),),
    args=("--health-check-interval", "1", "--health-check-timeout", "0.5"),
)  # fmt: skip


def test_a_stopped_replica_is_ejected_and_restored_while_the_other_serves(
    daemons: Daemons,
) -> None:
    with daemons.serve(TWO_REPLICAS) as daemon:
        job = daemon.job
        assert job is not None
        stopped: int | None = None
        try:
            client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0,
                                   timeout=120)  # fmt: skip
            target, other = both_ready(daemon, job)
            both = {target["replica_id"], other["replica_id"]}
            assert {served_by(client) for _ in range(4)} == both

            kinds = [e["kind"] for e in workload(daemon, job)["events"]]
            assert "ejected" not in kinds, kinds  # healthy replicas stay in routing

            stopped_at = time.time()
            os.kill(target["pid"], signal.SIGSTOP)
            stopped = target["pid"]
            ejected = wait_for_event(daemon, job, "ejected", stopped_at, timeout=60)
            took = ejected["ts"] - stopped_at
            print(f"ejected {took:.2f} s after SIGSTOP: {ejected['message']}")
            why = f"replica {target['replica_id']} out of routing: answers no request: "
            assert ejected["message"].startswith(why), ejected
            assert took <= 2 * INTERVAL_S + SLACK_S, ejected
            assert [served_by(client) for _ in range(3)] == [other["replica_id"]] * 3
            assert ejected_metric(daemon, target["replica_id"]) == 1.0

            continued_at = time.time()
            os.kill(target["pid"], signal.SIGCONT)
            stopped = None
            restored = wait_for_event(daemon, job, "restored", continued_at, timeout=60)
            took = restored["ts"] - continued_at
            print(f"restored {took:.2f} s after SIGCONT: {restored['message']}")
            assert restored["message"] == (
                f"replica {target['replica_id']} back in routing: its health probe passed"
            )
            assert took <= 2 * INTERVAL_S + SLACK_S, restored
            assert ejected_metric(daemon, target["replica_id"]) == 0.0
            assert target["replica_id"] in {served_by(client) for _ in range(4)}
            metrics = daemon.get("/metrics").text
            assert 'kunlun_health_ejections_total{model="tiny",reason="silent"} 1.0' in metrics
            assert 'kunlun_health_probes_total{model="tiny",result="silent"}' in metrics
            pids = {r["replica_id"]: r["pid"] for r in workload(daemon, job)["replicas"]}
            assert pids[target["replica_id"]] == target["pid"]  # ejected, never killed
        finally:
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, signal.SIGCONT)


BUSY_TOKENS = 1000
"""Tokens of each of the two streams that fill the batch: at the tiny model's speed they
keep it full across several checks one second apart."""


def test_a_replica_busy_with_a_full_batch_stays_in_routing(daemons: Daemons) -> None:
    """Two streams fill the replica's two sequence slots: the checks see the engine's step
    counter move (serving, no probe sent), or a probe waits behind the batch past its timeout
    and is answered late (slow) or not within the liveness deadline (busy); each keeps the
    replica in. (A stall needs a minute without a step with requests unfinished, far longer
    than the batch.) On a loaded machine one check may fall in the batch's few seconds: run
    AO's was slow. On a fast one the batch may end before the next check (the tiny model
    writes its 1,000 tokens in under a second on the compiled path: CI run BE): the batch is
    sent again until a check has fallen in one, at most ten times."""
    with daemons.serve(BUSY) as daemon:
        job = daemon.job
        assert job is not None
        for _ in range(10):
            full_batch(daemon.url)
            metrics = daemon.get("/metrics").text
            counts = {result: float(n) for result, n in re.findall(
                r'kunlun_health_probes_total\{model="tiny",result="(\w+)"\} (\S+)', metrics)}  # fmt: skip
            # checks during a batch saw the engine stepping (serving: no probe sent), or a
            # probe waited behind the full batch (slow, busy); none failed
            during = counts.get("serving", 0) + counts.get("slow", 0) + counts.get("busy", 0)
            if during >= 1:
                break
        assert during >= 1, metrics
        assert set(counts) <= {"serving", "busy", "pass", "slow"}, counts
        print(f"checks while the batch was full: {counts}")
        kinds = [e["kind"] for e in workload(daemon, job)["events"]]
        assert "ejected" not in kinds, workload(daemon, job)["events"]


def full_batch(url: str) -> None:
    """Two streams of BUSY_TOKENS at once (the replica's two sequence slots), to the end."""
    streams: list[tuple[list[str], threading.Event]] = [([], threading.Event()) for _ in "ab"]
    threads = [threading.Thread(target=stream_lines, args=(url, lines, started, BUSY_TOKENS),
                                kwargs={"model": "tiny"})
               for lines, started in streams]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert all(lines[0] == "status 200" and lines[-1] == "data: [DONE]"
               for lines, _ in streams), [lines[-1:] for lines, _ in streams]  # fmt: skip


def test_the_health_check_flags_are_validated(tmp_path: Path) -> None:
    for flag, value in (("--health-check-interval", "0.1"), ("--health-check-failures", "0")):
        proc = refused(tmp_path, flag, value)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert flag in proc.stderr
