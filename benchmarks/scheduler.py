"""Scheduler benchmark: the gateway's route decision, and a simulated heterogeneous node.

* ``route_decision_p99_us_64_replicas``: the time of :meth:`Admission.try_admit` (the ready
  replicas of the model, the ``load-aware`` choice, taking the slot) over 64 replicas with a
  realistic load state: requests in flight on every replica, outstanding tokens, fresh device
  samples for half of them (some above ``min_gpu_utilization_threshold``, some hot for more
  than 30 s). Each admission is released again outside the timed region.
* A deterministic discrete-event simulation of a 4-device node with service rates 1, 0.8,
  0.5 and 0.3 requests per second, Poisson arrivals at 80 % of the total capacity (2.08 per
  second, fixed seed), run through the gateway's own :class:`Admission`, :class:`Router` and
  :class:`Replica` objects once per policy. Each device serves the requests it holds by
  processor sharing (its rate split evenly among them, as a batch shares a step) and takes
  at most ``max_num_seqs`` 8 at once; the rest wait in the gateway's fair queue. A request's
  work is proportional to its token estimate (exponential, mean 256 tokens = one unit of
  work). Latencies are in milliseconds (one unit of time is one second); utilization is the
  share of time a device holds at least one request, from the end of the warm-up (the first
  5 % of requests, not counted) to the last arrival.

Prints one JSON object. ``--quick`` runs fewer iterations and requests (a smoke check).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kunlun.serving.admission import Admission, Ticket
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.serving.routing import DeviceLoad, DeviceSamples, Router
from kunlun.serving.scheduler_config import (
    QueueLimits,
    SchedulerConfig,
    SchedulerConfigSource,
)

sys.path.insert(0, str(Path(__file__).parent))
import placement  # noqa: E402  (benchmarks/placement.py, a sibling script)

MODEL = "m"
SERVICE_RATES = (1.0, 0.8, 0.5, 0.3)
LOAD = 0.8
MAX_NUM_SEQS = 8
TOKENS_PER_UNIT = 256
SEED = 20240611


def make_admission(config: SchedulerConfig) -> tuple[Admission, ReplicaSet, DeviceSamples]:
    source = SchedulerConfigSource()
    source.apply(config)
    samples = DeviceSamples()
    replicas = ReplicaSet()
    return Admission(replicas, Router(source, samples)), replicas, samples


# ---- the decision on 64 replicas ----


def route_decision(iterations: int) -> dict[str, float]:
    rng = random.Random(SEED)
    admission, replicas, samples = make_admission(SchedulerConfig(policy="load-aware"))
    now = time.time()
    for i in range(64):
        device = f"{('nvidia', 'ascend', 'cambricon', 'hygon')[i % 4]}:{i // 4}"
        in_flight = rng.randrange(0, 8)
        replica = Replica(f"r{i}", "w", MODEL, device, "http://127.0.0.1:1", ready=True,
                          max_num_seqs=8, in_flight=in_flight,
                          outstanding_tokens=in_flight * rng.randrange(200, 900))  # fmt: skip
        replicas.upsert(replica)
        if i % 2 == 0:
            hot = i % 8 == 0
            samples[device] = DeviceLoad(rng.uniform(20, 95), 90.0 if hot else 60.0, now - 40)
            samples[device] = DeviceLoad(rng.uniform(20, 95), 90.0 if hot else 60.0, now)
    timings = []
    ticket = Ticket(MODEL, "normal", None, 300)
    clock = time.perf_counter_ns
    for _ in range(iterations):
        start = clock()
        replica = admission.try_admit(ticket)
        elapsed = clock() - start
        if replica is None:
            raise RuntimeError("no replica chosen: the load state leaves no free slot")
        admission.release(ticket)
        timings.append(elapsed)
    timings.sort()
    return {
        "route_decision_p50_us_64_replicas": round(timings[len(timings) // 2] / 1000, 2),
        "route_decision_p99_us_64_replicas": round(timings[int(len(timings) * 0.99)] / 1000, 2),
    }


# ---- the simulated node ----


class _Job:
    __slots__ = ("ticket", "arrived", "work")

    def __init__(self, ticket: Ticket, arrived: float, work: float) -> None:
        self.ticket, self.arrived, self.work = ticket, arrived, work


def simulate(policy: str, num_requests: int) -> dict[str, Any]:
    """Run ``num_requests`` Poisson arrivals through the gateway's admission under ``policy``."""
    rng = random.Random(SEED)  # the same arrivals and work for both policies
    limits = QueueLimits(high=10**6, normal=10**6, low=10**6)
    admission, replicas, _ = make_admission(SchedulerConfig(policy=policy, queue_limits=limits))
    devices = []
    for i, rate in enumerate(SERVICE_RATES):
        replica = Replica(f"r{i}", "w", MODEL, f"sim:{i}", "", ready=True,
                          max_num_seqs=MAX_NUM_SEQS, max_queue=10**6)  # fmt: skip
        replicas.upsert(replica)
        devices.append(_Device(replica, rate))
    by_replica = {d.replica.replica_id: d for d in devices}
    jobs: dict[int, _Job] = {}
    arrival_rate = LOAD * sum(SERVICE_RATES)
    warm_up = num_requests // 20
    now, next_arrival, num_arrived = 0.0, rng.expovariate(arrival_rate), 0
    window = [0.0, 0.0]  # utilization is measured from the warm-up to the last arrival
    busy_at_end: list[float] = []
    latencies: list[float] = []

    def start(ticket: Ticket, at: float) -> None:
        assert ticket.replica is not None
        by_replica[ticket.replica.replica_id].start(jobs[id(ticket)], at)

    while num_arrived < num_requests or any(d.jobs for d in devices):
        next_done = min(devices, key=lambda d: d.next_completion(now))
        done_at = next_done.next_completion(now)
        at = next_arrival if num_arrived < num_requests else float("inf")
        if at <= done_at:
            for d in devices:
                d.advance(at - now)
            now = at
            num_arrived += 1
            if num_arrived == warm_up:
                window[0] = now
                for d in devices:
                    d.busy_time = 0.0
            if num_arrived == num_requests:
                window[1] = now
                busy_at_end = [d.busy_time for d in devices]
            tokens = 1 + int(rng.expovariate(1.0 / TOKENS_PER_UNIT))
            ticket = Ticket(MODEL, "normal", None, tokens)
            jobs[id(ticket)] = _Job(ticket, now if num_arrived > warm_up else -1.0,
                                    tokens / TOKENS_PER_UNIT)  # fmt: skip
            if admission.try_admit(ticket) is not None:
                start(ticket, now)
            else:
                admission.enqueue(ticket)
                for admitted in admission.dispatch(MODEL):
                    start(admitted, now)
            next_arrival = now + rng.expovariate(arrival_rate)
            continue
        for d in devices:
            d.advance(done_at - now)
        now = done_at
        job = next_done.finish()
        del jobs[id(job.ticket)]
        if job.arrived >= 0:
            latencies.append(now - job.arrived)
        for admitted in admission.release(job.ticket):
            start(admitted, now)
    utilization = [100.0 * busy / (window[1] - window[0]) for busy in busy_at_end]
    latencies.sort()
    return {
        "p95_latency_ms": round(1000 * latencies[int(len(latencies) * 0.95)], 1),
        "p50_latency_ms": round(1000 * latencies[len(latencies) // 2], 1),
        "utilization_pct": [round(u, 1) for u in utilization],
        "utilization_stddev_pct": round(statistics.pstdev(utilization), 2),
        "num_requests_measured": len(latencies),
    }


class _Device:
    """One simulated device: processor sharing at ``rate`` units of work per second."""

    def __init__(self, replica: Replica, rate: float) -> None:
        self.replica, self.rate = replica, rate
        self.attained = 0.0
        """Work done per held request since the start (the processor-sharing clock)."""
        self.jobs: list[tuple[float, int, _Job]] = []
        """Heap of (attained value at which the request finishes, tie-break, request)."""
        self.busy_time = 0.0
        self._seq = 0

    def next_completion(self, now: float) -> float:
        if not self.jobs:
            return float("inf")
        return now + (self.jobs[0][0] - self.attained) * len(self.jobs) / self.rate

    def advance(self, dt: float) -> None:
        if self.jobs and dt > 0:
            self.attained += dt * self.rate / len(self.jobs)
            self.busy_time += dt

    def start(self, job: _Job, now: float) -> None:
        self._seq += 1
        heapq.heappush(self.jobs, (self.attained + job.work, self._seq, job))

    def finish(self) -> _Job:
        return heapq.heappop(self.jobs)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations and requests")
    args = parser.parse_args()
    iterations, num_requests = (5_000, 20_000) if args.quick else (100_000, 200_000)

    result: dict[str, Any] = {}
    result.update(placement.measure(repeats=1 if args.quick else 3))
    result.update(route_decision(iterations))
    round_robin = simulate("round-robin", num_requests)
    load_aware = simulate("load-aware", num_requests)
    result.update(
        {
            "p95_latency_ms_round_robin": round_robin["p95_latency_ms"],
            "p95_latency_ms_load_aware": load_aware["p95_latency_ms"],
            "utilization_stddev_pct_load_aware": load_aware["utilization_stddev_pct"],
            "utilization_stddev_pct_round_robin": round_robin["utilization_stddev_pct"],
            "utilization_pct_round_robin": round_robin["utilization_pct"],
            "utilization_pct_load_aware": load_aware["utilization_pct"],
            "p50_latency_ms_round_robin": round_robin["p50_latency_ms"],
            "p50_latency_ms_load_aware": load_aware["p50_latency_ms"],
            "simulation": {
                "service_rates_per_s": list(SERVICE_RATES),
                "arrival_rate_per_s": round(LOAD * sum(SERVICE_RATES), 3),
                "max_num_seqs": MAX_NUM_SEQS,
                "num_requests": num_requests,
                "num_requests_measured": load_aware["num_requests_measured"],
                "seed": SEED,
            },
            "route_decision_iterations": iterations,
        }
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
