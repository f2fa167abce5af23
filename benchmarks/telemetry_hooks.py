"""CPU cost of the telemetry the gateway adds to each request.

Per admitted request the gateway takes three ``time.perf_counter()`` readings and calls
:meth:`GatewayMetrics.finished` once (a counter, a decision counter, two histogram
observations); per refused request it calls :meth:`GatewayMetrics.refused`. This times both
in a tight loop (after a warm-up, so the label children exist, as in a running daemon) over
8 replicas and 3 statuses, and reports the median of ``--repeats`` timings of ``--calls``
calls, in microseconds per request.

Usage: ``python benchmarks/telemetry_hooks.py [--calls N] [--repeats N]``. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from kunlun.protocol.openai_errors import QueueFull
from kunlun.telemetry.gateway_metrics import GatewayMetrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    metrics = GatewayMetrics()
    replicas = [(f"model-{i % 2}", f"wl-{i}-r0", "normal") for i in range(8)]
    statuses = (200, 200, 200, 429, 499)
    refusal = QueueFull("every replica of model 'model-0' has its queue full")

    def admitted(n: int) -> None:
        for i in range(n):
            arrived = time.perf_counter()
            dispatched = time.perf_counter()
            model, replica, priority = replicas[i % 8]
            metrics.finished(model, replica, priority, statuses[i % 5], arrived, dispatched)

    def refused(n: int) -> None:
        for _ in range(n):
            metrics.refused("model-0", True, refusal)

    result = {"benchmark": "gateway telemetry per request", "calls": args.calls,
              "repeats": args.repeats, "load_average": round(os.getloadavg()[0], 1)}  # fmt: skip
    for name, work in (("admitted_us", admitted), ("refused_us", refused)):
        work(1000)  # warm-up: label children created
        timings = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            work(args.calls)
            timings.append((time.perf_counter() - started) / args.calls * 1e6)
        result[name] = round(statistics.median(timings), 3)
        result[name.replace("_us", "_us_min")] = round(min(timings), 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
