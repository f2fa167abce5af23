"""The gateway's backlog: weighted fair queuing in virtual time, class limits, waiters that
leave, on real :class:`Replica` objects behind a real :class:`Admission`."""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import Counter
from collections.abc import Callable

import pytest

from kunlun.protocol.openai_errors import QueueFull, ServiceUnavailable
from kunlun.serving.admission import MAX_RETRY_AFTER_S, Admission, DrainRate, Ticket
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.serving.routing import DeviceSamples, Router
from kunlun.serving.scheduler_config import SchedulerConfig, SchedulerConfigSource

MODEL = "m"
BIG = {"high": 10**6, "normal": 10**6, "low": 10**6}


def make(
    devices: list[str],
    max_num_seqs: int = 2,
    max_queue: int = 10**6,
    clock: Callable[[], float] = time.monotonic,
    **config: object,
) -> tuple[Admission, ReplicaSet, list[Replica]]:
    source = SchedulerConfigSource()
    source.apply(SchedulerConfig.model_validate({"queue_limits": BIG, **config}))
    replicas = ReplicaSet()
    made = []
    for i, device in enumerate(devices):
        made.append(Replica(f"r{i}", "w", MODEL, device, "", ready=True,
                            max_num_seqs=max_num_seqs, max_queue=max_queue))  # fmt: skip
        replicas.upsert(made[-1])
    return Admission(replicas, Router(source, DeviceSamples()), clock), replicas, made


class VirtualNode:
    """Every admitted request is served for exactly one unit of virtual time."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.now = 0.0
        self._seq = 0
        self._in_service: list[tuple[float, int, Ticket]] = []
        self.completed: list[str] = []

    def start(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            self._seq += 1
            heapq.heappush(self._in_service, (self.now + 1.0, self._seq, ticket))

    def run(self, num_completions: int) -> Counter[str]:
        """Complete ``num_completions`` requests; how many of each class finished."""
        done: Counter[str] = Counter()
        for _ in range(num_completions):
            self.now, _, ticket = heapq.heappop(self._in_service)
            done[ticket.priority] += 1
            self.completed.append(ticket.priority)
            self.start(self.admission.release(ticket))
        return done


def backlog(admission: Admission, counts: dict[str, int]) -> None:
    for priority, count in counts.items():
        for _ in range(count):
            admission.enqueue(Ticket(MODEL, priority, None, 100))


def test_wfq_high_completes_three_times_low_when_both_are_backlogged() -> None:
    def run() -> tuple[Counter[str], list[str]]:
        admission, _, _ = make(["cpu:0", "cpu:1"])
        backlog(admission, {"low": 600, "high": 600})  # low queued first: no head start
        node = VirtualNode(admission)
        node.start(admission.dispatch(MODEL))
        return node.run(400), node.completed

    done, order = run()
    assert done["high"] + done["low"] == 400
    assert 3 * 0.85 <= done["high"] / done["low"] <= 3 * 1.15, done
    assert run()[1] == order  # deterministic


def test_wfq_three_classes_follow_the_configured_weights() -> None:
    admission, _, _ = make(["cpu:0"], max_num_seqs=1, priority_weights={"high": 4, "low": 1})
    backlog(admission, {"high": 500, "normal": 500, "low": 500})
    node = VirtualNode(admission)
    node.start(admission.dispatch(MODEL))
    done = node.run(700)
    assert (done["high"], done["normal"], done["low"]) == (400, 200, 100)


def test_a_class_that_was_idle_gets_no_credit_for_it() -> None:
    admission, _, _ = make(["cpu:0"], max_num_seqs=1)
    backlog(admission, {"low": 1000})
    node = VirtualNode(admission)
    node.start(admission.dispatch(MODEL))
    node.run(100)
    backlog(admission, {"high": 1000})  # high arrives late: it gets 3 of 4, not everything
    done = node.run(200)
    assert 140 <= done["high"] <= 160 and done["low"] >= 40, done


def test_class_queue_limit_answers_queue_full_naming_the_class() -> None:
    clock = Clock()
    admission, _, [replica] = make(
        ["cpu:0"], max_num_seqs=1, clock=clock, queue_limits={"high": 5, "normal": 5, "low": 2}
    )
    assert admission.try_admit(Ticket(MODEL, "normal", None, 10)) is replica
    backlog(admission, {"low": 2})
    with pytest.raises(QueueFull) as caught:
        admission.enqueue(Ticket(MODEL, "low", None, 10))
    assert "low-priority queue" in caught.value.message
    assert "queue_limits.low = 2" in caught.value.message
    # one admission in the last second: 1/s; two waiting and the refused one: 3 s
    assert caught.value.retry_after_s == 3
    admission.enqueue(Ticket(MODEL, "high", None, 10))  # other classes still queue


def test_max_queue_still_bounds_in_flight_plus_waiting() -> None:
    admission, _, [replica] = make(["cpu:0"], max_num_seqs=8, max_queue=3)
    for _ in range(3):
        assert admission.try_admit(Ticket(MODEL, "normal", None, 10)) is replica
    assert replica.in_flight == 3  # slots = min(max_num_seqs, max_queue)
    ticket = Ticket(MODEL, "normal", None, 10)
    assert admission.try_admit(ticket) is None
    with pytest.raises(QueueFull, match="max_queue 3"):
        admission.enqueue(ticket)


def test_a_waiter_is_admitted_when_a_slot_frees() -> None:
    async def scenario() -> None:
        admission, _, [replica] = make(["cpu:0"], max_num_seqs=1)
        first, second = Ticket(MODEL, "normal", None, 10), Ticket(MODEL, "normal", None, 20)
        assert admission.try_admit(first) is replica
        waiting = asyncio.create_task(admission.wait(second))
        await asyncio.sleep(0)
        assert admission.num_waiting() == 1 and not waiting.done()
        assert admission.release(first) == [second]
        assert await waiting is replica
        assert (replica.in_flight, replica.outstanding_tokens) == (1, 20)

    asyncio.run(scenario())


def test_a_waiter_whose_client_leaves_leaves_the_queue() -> None:
    async def scenario() -> None:
        admission, _, [replica] = make(["cpu:0"], max_num_seqs=1)
        first = Ticket(MODEL, "normal", None, 10)
        assert admission.try_admit(first) is replica
        waiting = asyncio.create_task(admission.wait(Ticket(MODEL, "normal", None, 20)))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert admission.num_waiting() == 0
        assert admission.release(first) == []
        assert (replica.in_flight, replica.outstanding_tokens) == (0, 0)

    asyncio.run(scenario())


def test_a_waiter_cancelled_just_after_admission_gives_its_slot_back() -> None:
    async def scenario() -> None:
        admission, _, [replica] = make(["cpu:0"], max_num_seqs=1)
        first, second = Ticket(MODEL, "normal", None, 10), Ticket(MODEL, "normal", None, 20)
        admission.try_admit(first)
        waiting = asyncio.create_task(admission.wait(second))
        await asyncio.sleep(0)
        admission.release(first)  # second takes the slot ...
        waiting.cancel()  # ... but its client left before it could use it
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (replica.in_flight, replica.outstanding_tokens) == (0, 0)

    asyncio.run(scenario())


def test_a_waiter_for_a_full_pool_does_not_block_another_pool() -> None:
    admission, _, [cpu, cuda] = make(["cpu:0", "cuda:0"], max_num_seqs=1)
    on_cpu = Ticket(MODEL, "normal", "cpu", 10)
    assert admission.try_admit(on_cpu) is cpu
    assert admission.try_admit(Ticket(MODEL, "normal", "cuda", 10)) is cuda
    wants_cuda, wants_cpu = Ticket(MODEL, "normal", "cuda", 10), Ticket(MODEL, "normal", "cpu", 10)
    admission.enqueue(wants_cuda)
    admission.enqueue(wants_cpu)
    assert admission.release(on_cpu) == [wants_cpu]
    assert wants_cpu.replica is cpu and admission.num_waiting() == 1


def test_waiters_of_a_model_no_longer_served_get_503() -> None:
    async def scenario() -> None:
        admission, replicas, [replica] = make(["cpu:0"], max_num_seqs=1)
        admission.try_admit(Ticket(MODEL, "normal", None, 10))
        waiting = asyncio.create_task(admission.wait(Ticket(MODEL, "low", None, 10)))
        await asyncio.sleep(0)
        replicas.remove(replica.replica_id)  # the workload stopped
        admission.dispatch_all()
        with pytest.raises(ServiceUnavailable, match="no longer served"):
            await waiting
        assert admission.num_waiting() == 0

    asyncio.run(scenario())


def test_waiters_for_a_pool_no_longer_served_get_503() -> None:
    async def scenario() -> None:
        admission, replicas, [cpu, cuda] = make(["cpu:0", "cuda:0"], max_num_seqs=1)
        admission.try_admit(Ticket(MODEL, "normal", "cuda", 10))
        waiting = asyncio.create_task(admission.wait(Ticket(MODEL, "normal", "cuda", 10)))
        await asyncio.sleep(0)
        replicas.remove(cuda.replica_id)
        admission.dispatch_all()
        with pytest.raises(ServiceUnavailable, match="pool 'cuda' of model 'm'"):
            await waiting
        assert admission.num_waiting() == 0 and cpu.in_flight == 0

    asyncio.run(scenario())


class Clock:
    """A hand-moved clock for drain rates."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_drain_rate_is_admissions_per_second_over_the_recent_window() -> None:
    clock = Clock()
    rate = DrainRate(window_s=30.0, clock=clock)
    assert rate.per_second() is None
    assert rate.retry_after(5, fallback_s=42) == 42  # nothing measured: the fallback
    for _ in range(10):  # one admission every 0.5 s
        rate.admitted()
        clock.now += 0.5
    assert rate.per_second() == pytest.approx(10 / 5.0)
    assert rate.retry_after(1, 60) == 1
    assert rate.retry_after(7, 60) == 4  # 7 ahead at 2/s: ceil(3.5)
    assert rate.retry_after(40, 60) == 20  # grows with the queue
    clock.now += 15.0  # the queue stopped draining: the rate decays
    assert rate.per_second() == pytest.approx(10 / 20.0)
    assert rate.retry_after(7, 60) == 14
    clock.now += 31.0  # everything left the window
    assert rate.per_second() is None
    assert rate.retry_after(10**9, 1e9) == MAX_RETRY_AFTER_S


def test_a_request_waiting_past_max_queue_wait_gets_429_with_a_drain_rate_retry_after() -> None:
    async def scenario() -> None:
        clock = Clock()
        admission, _, [replica] = make(
            ["cpu:0"], max_num_seqs=1, clock=clock, max_queue_wait_s=0.05
        )
        first = Ticket(MODEL, "normal", None, 10)
        assert admission.try_admit(first) is replica
        for _ in range(3):  # three requests drained in the last 2 s (and the first)
            clock.now += 0.5
            admission.release(first)
            assert admission.try_admit(first) is replica
        clock.now += 0.5
        waiters = [Ticket(MODEL, "normal", None, 10) for _ in range(4)]
        tasks = [asyncio.create_task(admission.wait(t)) for t in waiters]
        done, _ = await asyncio.wait(tasks, timeout=30)
        assert len(done) == 4
        retry_after = []
        for task in tasks:
            with pytest.raises(QueueFull, match="max_queue_wait_s = 0.05") as caught:
                task.result()
            retry_after.append(caught.value.retry_after_s)
        # 4 admissions over 2 s: 2/s; those refused first had more still waiting behind
        assert retry_after == [2, 2, 1, 1]
        assert admission.num_waiting() == 0 and replica.in_flight == 1

    asyncio.run(scenario())


def test_a_request_admitted_before_max_queue_wait_is_not_refused() -> None:
    async def scenario() -> None:
        admission, _, [replica] = make(["cpu:0"], max_num_seqs=1, max_queue_wait_s=60)
        first = Ticket(MODEL, "normal", None, 10)
        admission.try_admit(first)
        second = Ticket(MODEL, "normal", None, 10)
        waiting = asyncio.create_task(admission.wait(second))
        await asyncio.sleep(0)
        admission.release(first)
        assert await waiting is replica

    asyncio.run(scenario())
