"""Canary rollouts on a real daemon with real workers (the tiny model): a good canary
promotes through every step (twenty in a row: ``benchmarks/rollout.py --good 20``), a canary made to fail requests (``faults.error_rate``) or to
be slow (``faults.delay_ms``) rolls back on its own, an idle one waits, sessions stick to a
version, and a rollout survives a daemon restart."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests import loopback
from tests.daemons import Daemon
from tests.rollout.conftest import wait_serving
from tests.rollout.rollout_load import FAST, Load, create, status, wait_for


def states(daemon: Daemon) -> dict[str, str]:
    rows = json.loads(daemon.cli("workload", "list", "--json").stdout)
    return {w["workload_id"]: w["state"] for w in rows}


def test_a_good_canary_promotes_through_every_step(platform: Daemon, tiny_model: Path) -> None:
    started = create(
        platform.url, workload="chat", model=str(tiny_model), steps="20,50,100", **FAST
    )
    assert started["state"] == "STARTING" and started["steps"] == [20, 50, 100]
    with Load(platform.url, "chat") as load:
        ended = wait_for(platform.url, started["rollout_id"])
    assert ended["state"] == "PROMOTED", ended
    # each step's last window passed every gate (a step may have been measured twice)
    last = {h["weight"]: h for h in ended["history"]}
    assert list(last) == [20, 50], ended["history"]
    for window in last.values():
        assert {g["gate"]: g["verdict"] for g in window["gates"]} == {
            "error_rate": "pass", "p95_ttft": "pass", "p95_e2e": "pass"}  # fmt: skip
    assert load.count("canary", 200) > 0 and load.count("baseline", 200) > 0
    # every request answered (those after the end, once the baseline stopped, name no version)
    assert not load.failures and {code for code, _ in load.answers} == {200}, load.answers
    workloads = states(platform)
    assert workloads[ended["workload_id"]] == "STOPPED"
    assert workloads[ended["canary_workload_id"]] == "RUNNING"
    events = platform.describe(ended["canary_workload_id"])["events"]
    assert any("PROMOTED" in e["message"] for e in events), events


def test_a_failing_canary_rolls_back_by_itself(platform: Daemon, tiny_model: Path) -> None:
    started = create(platform.url, workload="chat", model=str(tiny_model), steps="20,50,100",
                     overrides={"faults": {"error_rate": 0.5, "seed": 1}}, **FAST)  # fmt: skip
    begun = time.monotonic()
    with Load(platform.url, "chat") as load:
        ended = wait_for(platform.url, started["rollout_id"])
        took = time.monotonic() - begun
    assert ended["state"] == "ROLLED_BACK", ended
    assert "gate error_rate failed" in ended["reason"], ended["reason"]
    print(
        f"bad canary rolled back {took:.1f} s after its rollout began; "
        f"{load.count('canary')} requests reached it"
    )
    assert load.count("canary", 500) >= 1
    assert states(platform)[ended["canary_workload_id"]] == "STOPPED"
    baseline = platform.describe(ended["workload_id"])
    assert baseline["state"] == "RUNNING"
    assert any("ROLLED_BACK" in e["message"] for e in baseline["events"])
    after = loopback.post(platform.url + "/v1/chat/completions", timeout=60, json={
        "model": "chat", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert after.status_code == 200 and "x-kunlun-version" not in after.headers
    metrics = platform.get("/metrics").text
    assert 'kunlun_rollout_rollbacks_total{model="chat",reason="error_rate"}' in metrics
    assert (
        f'kunlun_rollout_state{{model="chat",rollout="{ended["rollout_id"]}",state="ROLLED_BACK"}} 1.0'
        in metrics
    )


def test_a_slow_canary_fails_the_p95_gate(platform: Daemon, tiny_model: Path) -> None:
    # The delay must stand out of the baseline's spread over 20 samples: on the demo model
    # 400 ms passed the gate on a loaded machine (canary p95 913 ms against a baseline bound
    # of 650 ms), as it should; the tiny model answers in tens of ms, so 1.5 s stands out.
    started = create(platform.url, workload="chat", model=str(tiny_model), steps="50",
                     overrides={"faults": {"delay_ms": 1500}, "max_num_seqs": 16}, **FAST)  # fmt: skip
    # A regression counts once two windows of 20 canary samples show it: sixteen clients and
    # as many slots on the canary keep many of its 1.5 s requests in flight at once, so the
    # samples come in seconds (at the baseline's 4 slots, about 10 s a window).
    with Load(platform.url, "chat", concurrency=16):
        ended = wait_for(platform.url, started["rollout_id"])
    assert ended["state"] == "ROLLED_BACK", ended
    assert "gate p95_ttft failed" in ended["reason"] or "gate p95_e2e failed" in ended["reason"]
    assert "gate error_rate" not in ended["reason"]


def test_an_idle_canary_stays_inconclusive_then_aborts(platform: Daemon, tiny_model: Path) -> None:
    started = create(platform.url, workload="chat", model=str(tiny_model), steps="50", **FAST)
    rollout_id = started["rollout_id"]
    begun = wait_for(platform.url, rollout_id, ("PROGRESSING",))
    # three of its intervals pass without a request (by the rollout's own clock)
    deadline = time.monotonic() + 120
    while (idle := status(platform.url, rollout_id))["state"] == "PROGRESSING" and (
        time.time() < begun["step_started"] + 3 * begun["interval_s"]
    ):
        assert time.monotonic() < deadline, idle
        time.sleep(0.1)
    assert idle["state"] == "PROGRESSING" and idle["step"] == 0, idle
    assert {g["verdict"] for g in idle["gates"]} == {"inconclusive"}, idle["gates"]
    shown = platform.cli("rollout", "status", rollout_id)
    assert shown.returncode == 0, shown.stderr
    assert "INCONCLUSIVE" in shown.stdout and "waiting for 20" in shown.stdout, shown.stdout
    aborted = platform.cli("rollout", "abort", rollout_id, "--json")
    assert aborted.returncode == 0, aborted.stderr
    assert json.loads(aborted.stdout)["state"] == "ABORTED"
    assert states(platform)[started["canary_workload_id"]] == "STOPPED"


def test_sessions_stick_to_one_version(platform: Daemon, tiny_model: Path) -> None:
    started = create(platform.url, workload="chat", model=str(tiny_model), steps="50",
                     interval_s="10m", min_requests=1000)  # fmt: skip
    wait_for(platform.url, started["rollout_id"], ("PROGRESSING",))
    try:
        seen: dict[str, set[str]] = {}
        for session in ("alice", "bob", "carol", "dave", "erin", "frank"):
            for _ in range(3):
                answer = loopback.post(platform.url + "/v1/chat/completions", timeout=60,
                                    headers={"X-Kunlun-Session": session},
                                    json={"model": "chat", "max_tokens": 1, "messages": [
                                        {"role": "user", "content": "hi"}]})  # fmt: skip
                assert answer.status_code == 200, answer.text
                seen.setdefault(session, set()).add(answer.headers["x-kunlun-version"])
        assert all(len(versions) == 1 for versions in seen.values()), seen
        roles = {next(iter(v)).partition(":")[0] for v in seen.values()}
        assert roles == {"baseline", "canary"}, seen  # six sessions at 50 %: both (fixed hash)
    finally:
        platform.cli("rollout", "abort", started["rollout_id"])


def test_a_rollout_survives_a_daemon_restart(platform: Daemon, tiny_model: Path) -> None:
    made = platform.cli("rollout", "create", "--workload", "chat", "--model", str(tiny_model),
                        "--steps", "30,60", "--interval", "10m", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    rollout_id = json.loads(made.stdout)["rollout_id"]
    before = wait_for(platform.url, rollout_id, ("PROGRESSING",))
    assert platform.stop() == 0
    platform.start(wait_ready=False)
    after = status(platform.url, rollout_id)
    assert after["state"] == "PROGRESSING" and after["step"] == before["step"] == 0, after
    wait_serving(platform, after["canary_workload_id"])
    listed = platform.cli("rollout", "list")
    assert rollout_id in listed.stdout and "PROGRESSING" in listed.stdout, listed.stdout
    promoted = platform.cli("rollout", "promote", rollout_id, "--json")
    assert promoted.returncode == 0, promoted.stderr
    assert json.loads(promoted.stdout)["state"] == "PROMOTED"
    assert states(platform)[after["workload_id"]] == "STOPPED"
