"""The health checker's verdict on a replica from its probes (times passed in), and the
checker acting on them over a mock transport (no network)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.core import Metric

from kunlun.node.health import (
    PROBE_HEADER,
    HealthChecker,
    HealthConfig,
    ReplicaHealth,
    Verdict,
)
from kunlun.serving.replica import Replica, ReplicaSet

CONFIG = HealthConfig(interval_s=5.0, timeout_s=2.0, failures=2)


def stats(num_steps: int, unfinished: int) -> dict[str, int]:
    return {"num_steps": num_steps, "num_unfinished_requests": unfinished}


@pytest.fixture(autouse=True)
def _no_stall_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """These verdicts use probe times of seconds; the 60 s floor of a stall is tested alone."""
    import kunlun.node.health

    monkeypatch.setattr(kunlun.node.health, "STALL_MIN_S", 0.0)


def test_a_pass_clears_the_failures() -> None:
    health = ReplicaHealth(CONFIG)
    assert health.failed("500: boom", stats(3, 0), now=0.0) == Verdict("error")
    assert health.passed(stats(4, 0), now=5.0) == Verdict("pass")
    assert health.failed("500: boom", stats(5, 0), now=10.0) == Verdict("error")  # one again
    assert health.ejected is None


def test_failures_error_answers_in_a_row_eject_naming_the_status_and_message() -> None:
    health = ReplicaHealth(CONFIG)
    assert health.failed("500: engine exploded", None, now=0.0) == Verdict("error")
    verdict = health.failed("503: engine exploded", None, now=5.0)
    assert verdict.result == "error" and verdict.eject is not None
    assert "2 health probes in a row failed" in verdict.eject
    assert "503: engine exploded" in verdict.eject
    assert health.ejected == verdict.eject
    again = health.failed("500: still", None, now=10.0)
    assert again == Verdict("error")  # already out: no second ejection, the first reason stays
    assert health.ejected == verdict.eject


def test_one_failure_ejects_when_failures_is_1() -> None:
    health = ReplicaHealth(HealthConfig(failures=1))
    verdict = health.failed("500: boom", None, now=0.0)
    assert verdict.eject == "its health probe was answered 500: boom"


def test_an_ejected_replica_is_restored_by_a_passing_probe() -> None:
    health = ReplicaHealth(CONFIG)
    health.failed("500: a", None, now=0.0)
    assert health.failed("500: b", None, now=5.0).eject is not None
    assert health.passed(stats(9, 0), now=10.0) == Verdict("pass", restore=True)
    assert health.ejected is None and health.num_failures == 0
    assert health.passed(stats(10, 0), now=15.0) == Verdict("pass")  # restored once


def test_busy_but_progressing_is_a_pass() -> None:
    health = ReplicaHealth(CONFIG)
    assert health.passed(stats(100, 8), now=0.0) == Verdict("pass")
    for i, now in enumerate((7.0, 14.0, 21.0, 28.0)):  # a full batch: probes wait, steps move
        verdict = health.unanswered("timed out", stats(200 + i, 8), now=now)
        assert verdict == Verdict("busy")
    assert health.ejected is None and health.num_failures == 0


def test_busy_restores_a_replica_whose_engine_moves_again() -> None:
    health = ReplicaHealth(CONFIG)
    health.passed(stats(10, 3), now=0.0)
    assert health.unanswered("timed out", stats(10, 3), now=7.0) == Verdict("stalled")
    assert health.unanswered("timed out", stats(10, 3), now=14.0).eject is not None
    assert health.unanswered("timed out", stats(11, 3), now=21.0) == Verdict("busy", restore=True)


def test_silent_ejects_at_once() -> None:
    health = ReplicaHealth(CONFIG)
    health.passed(stats(10, 0), now=0.0)
    verdict = health.unanswered("timed out", None, now=7.0)
    assert verdict.result == "silent" and verdict.eject is not None
    assert verdict.eject.startswith("answers no request: ")
    assert "no answer within 2 s (timed out), nor /stats" in verdict.eject


def test_a_refused_connection_is_silent_too() -> None:
    health = ReplicaHealth(CONFIG)
    verdict = health.unanswered("ConnectError: All connection attempts failed", None, now=0.0)
    assert verdict.result == "silent" and verdict.eject is not None
    assert "ConnectError" in verdict.eject


def test_an_engine_with_requests_and_no_step_for_failures_probes_is_stalled() -> None:
    health = ReplicaHealth(CONFIG)
    assert health.passed(stats(40, 2), now=0.0) == Verdict("pass")
    assert health.unanswered("timed out", stats(40, 3), now=7.0) == Verdict("stalled")  # one step
    verdict = health.unanswered("timed out", stats(40, 3), now=14.0)  # may outlast an interval
    assert verdict.result == "stalled"
    assert verdict.eject == (
        "2 health probes in a row failed; the last: its engine made no step in 14.0 s with "
        "3 request(s) unfinished (stalled)"
    )


def test_a_stall_ejects_at_once_when_failures_is_1() -> None:
    health = ReplicaHealth(HealthConfig(failures=1))
    health.passed(stats(40, 2), now=0.0)
    verdict = health.unanswered("timed out", stats(40, 3), now=7.0)
    assert (
        verdict.eject == "its engine made no step in 7.0 s with 3 request(s) unfinished (stalled)"
    )


def test_work_that_just_arrived_is_not_a_stall() -> None:
    health = ReplicaHealth(CONFIG)
    health.passed(stats(40, 0), now=0.0)  # idle at the previous probe
    assert health.unanswered("timed out", stats(40, 5), now=7.0) == Verdict("busy")  # a long step
    assert health.unanswered("timed out", stats(40, 5), now=14.0) == Verdict("stalled")
    verdict = health.unanswered("timed out", stats(40, 5), now=21.0)
    assert verdict.eject is not None
    assert "no step in 14.0 s with 5 request(s) unfinished (stalled)" in verdict.eject


def test_steps_that_moved_on_an_engine_now_idle_are_progress() -> None:
    health = ReplicaHealth(CONFIG)
    health.passed(stats(40, 0), now=0.0)
    assert health.unanswered("timed out", stats(41, 0), now=7.0) == Verdict("busy")


def test_no_previous_sample_gives_the_benefit_of_the_doubt() -> None:
    health = ReplicaHealth(CONFIG)
    health.passed(None, now=0.0)  # /stats did not answer after the pass
    assert health.unanswered("timed out", stats(40, 5), now=7.0) == Verdict("busy")


def test_unanswered_probes_that_stats_cannot_explain_count_as_errors() -> None:
    health = ReplicaHealth(CONFIG)
    health.passed(stats(40, 0), now=0.0)
    first = health.unanswered("timed out", stats(40, 0), now=7.0)  # idle, no step
    assert first == Verdict("error")
    second = health.unanswered("timed out", {"status": "ok"}, now=14.0)  # no counters
    assert second.result == "error" and second.eject is not None
    assert "reports no steps" in second.eject


def test_config_is_validated_and_the_timeout_kept_under_the_interval() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0"):
        HealthConfig(interval_s=0)
    with pytest.raises(ValueError, match="failures must be > 0"):
        HealthConfig(failures=0)
    assert HealthConfig(interval_s=1.0, timeout_s=3.0).probe_timeout_s == 1.0
    assert HealthConfig(interval_s=1.0, timeout_s=3.0).stats_timeout_s == 1.0
    assert HealthConfig(interval_s=5.0, timeout_s=0.5).stats_timeout_s == 0.5


def test_a_replica_whose_engine_stepped_since_the_last_check_is_serving() -> None:
    health = ReplicaHealth(CONFIG)
    assert health.serving(stats(10, 1), now=0.0) is None  # nothing to compare with: probe
    assert health.passed(stats(10, 1), now=0.5) == Verdict("pass")
    assert health.serving(stats(14, 2), now=5.0) == Verdict("serving")  # no probe needed
    assert health.serving(stats(14, 0), now=10.0) is None  # no step since: it gets a probe
    assert health.passed(stats(14, 0), now=10.5) == Verdict("pass")
    assert health.serving({"num_steps": 20}, now=15.0) is None  # no counters: probe


def test_serving_never_restores_an_ejected_replica() -> None:
    health = ReplicaHealth(CONFIG)
    health.failed("500: boom", stats(1, 3), now=0.0)
    assert health.failed("500: boom", stats(2, 3), now=5.0).eject is not None
    assert health.serving(stats(9, 3), now=10.0) is None  # in-flight requests still step
    assert health.ejected is not None
    assert health.passed(stats(9, 0), now=10.5) == Verdict("pass", restore=True)


# ---- the checker over a mock transport ----

Handler = Callable[[httpx.Request], httpx.Response]


def completion() -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"text": "!", "index": 0}]})


def checked(
    handler: Handler | Callable[[httpx.Request], Any], replicas: ReplicaSet, rounds: int,
    slow_s: float = 15.0,
) -> tuple[HealthChecker, list[tuple[str, str, str]]]:  # fmt: skip
    """A checker over ``replicas`` that probes ``rounds`` times (interval 0.2 s)."""
    events: list[tuple[str, str, str]] = []
    checker = HealthChecker(
        replicas, HealthConfig(interval_s=0.2, timeout_s=0.1, failures=2, slow_s=slow_s),
        lambda *event: events.append(event),
    )  # fmt: skip

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for second in range(rounds):  # each a probe interval apart or more
                checker.tick(client, float(second))
                await asyncio.gather(*(t.task for t in checker._tracked.values() if t.task))

    asyncio.run(go())
    return checker, events


def replica(rid: str = "w1-r0", ready: bool = True, node: str | None = None) -> Replica:
    return Replica(rid, "w1", "m", "cpu:0", f"http://{rid}", ready=ready, pid=1, node=node)


def test_the_checker_sends_the_probe_and_ejects_and_restores_with_events() -> None:
    seen: list[httpx.Request] = []
    answers = iter(["500", "500", "ok", "ok"])

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/stats":
            return httpx.Response(200, json=stats(len(seen), 0))
        seen.append(request)
        if next(answers) == "500":
            return httpx.Response(500, json={"error": {"message": "engine exploded"}})
        return completion()

    replicas = ReplicaSet()
    replicas.upsert(r := replica())
    checker, events = checked(handler, replicas, rounds=4)
    probe = seen[0]
    assert probe.method == "POST" and probe.url == "http://w1-r0/v1/completions"
    assert probe.headers[PROBE_HEADER] == "1"
    assert json.loads(probe.content) == {"model": "m", "prompt": "ping", "max_tokens": 1,
                                         "temperature": 0}  # fmt: skip
    assert [kind for _, kind, _ in events] == ["ejected", "restored"]
    assert events[0][0] == "w1"
    assert events[0][2].startswith("replica w1-r0 out of routing: 2 health probes in a row")
    assert "500: engine exploded" in events[0][2]
    assert events[1][2] == "replica w1-r0 back in routing: its health probe passed"
    assert r.ejected is None and r.routable
    assert checker.num_probes == {("m", "error"): 2, ("m", "pass"): 2}
    assert checker.num_ejections == {("m", "error"): 1}
    text = exposition(checker.families())
    assert 'kunlun_replica_ejected{device="cpu:0",model="m",replica="w1-r0"} 0.0' in text
    assert 'kunlun_health_ejections_total{model="m",reason="error"} 1.0' in text
    assert 'kunlun_health_probes_total{model="m",result="pass"} 2.0' in text


@pytest.mark.parametrize("task", ["generate", "embed"])
def test_an_idle_replica_that_answers_late_is_slow_not_dead(task: str) -> None:
    """Issue 34: an idle embeddings replica on a busy host answered its probe after the 2 s
    timeout and was ejected and restored every few seconds. While ``/stats`` answers, the
    probe waits on (up to ``slow_s``): a late answer is a pass, marked ``slow``."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/stats":
            return httpx.Response(200, json=stats(7, 0))  # idle: no step, nothing unfinished
        await asyncio.sleep(0.3)  # three timeouts late
        data = {"data": [{"embedding": [0.0]}]} if task == "embed" else None
        return httpx.Response(200, json=data) if data else completion()

    for slow_s, results, kinds in (
        (15.0, {"slow": 3}, []),
        (0.2, {"busy": 1, "error": 2}, ["ejected"]),
    ):  # the old way
        replicas = ReplicaSet()
        replicas.upsert(dataclasses.replace(replica(), task=task))
        checker, events = checked(handler, replicas, rounds=3, slow_s=slow_s)
        assert checker.num_probes == {("m", k): n for k, n in results.items()}, slow_s
        assert [kind for _, kind, _ in events] == kinds, events


def test_the_checker_sends_no_probe_to_a_replica_that_is_serving() -> None:
    reads = []
    probes = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/stats":  # real traffic: the engine steps between reads
            reads.append(request)
            return httpx.Response(200, json=stats(len(reads), 1))
        probes.append(request)
        return completion()

    replicas = ReplicaSet()
    replicas.upsert(replica())
    checker, events = checked(handler, replicas, rounds=4)
    assert len(probes) == 1  # the first check has no earlier steps to compare with
    assert checker.num_probes == {("m", "pass"): 1, ("m", "serving"): 3}
    assert not events
    text = exposition(checker.families())
    assert 'kunlun_health_probes_total{model="m",result="serving"} 3.0' in text


def test_the_checker_ejects_a_silent_replica_at_once_and_skips_others() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "w1-r0":
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/stats":
            return httpx.Response(200, json=stats(1, 0))
        return completion()

    replicas = ReplicaSet()
    replicas.upsert(silent := replica())
    replicas.upsert(fine := replica("w1-r1"))
    replicas.upsert(starting := replica("w1-r2", ready=False))
    replicas.upsert(remote := replica("node-b/w1-r3", node="node-b"))
    checker, events = checked(handler, replicas, rounds=2)
    assert silent.ejected is not None and silent.ejected.startswith("answers no request")
    assert not silent.routable
    assert fine.ejected is None and starting.ejected is None and remote.ejected is None
    assert [(kind, msg.split(":")[0]) for _, kind, msg in events] == [
        ("ejected", "replica w1-r0 out of routing")
    ]
    assert checker.num_ejections == {("m", "silent"): 1}
    text = exposition(checker.families())
    assert 'kunlun_replica_ejected{device="cpu:0",model="m",replica="w1-r0"} 1.0' in text
    assert 'replica="node-b/w1-r3"' not in text  # its own node reports it


def test_a_replica_that_stops_being_ready_is_forgotten_and_back_in_routing() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    replicas = ReplicaSet()
    replicas.upsert(r := replica())
    checker, _ = checked(handler, replicas, rounds=1)
    assert r.ejected is not None
    r.ready = False  # the supervisor restarts it

    async def tick() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            checker.tick(client, 0.0)

    asyncio.run(tick())
    assert r.ejected is None and not checker._tracked


def exposition(families: Iterable[Metric]) -> str:
    class Source:
        def collect(self) -> Iterable[Metric]:
            return families

    return generate_latest(Source()).decode()
