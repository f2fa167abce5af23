"""The daemon's event loop during a Metrics-page sample and a ``/metrics`` scrape; prints JSON.

Every 5 s the daemon samples its own exposition for the Metrics page's history
(:mod:`kunlun.ui.history`), and every scrape of ``GET /metrics`` parses each worker's
exposition (:mod:`kunlun.daemon.exposition`). The same event loop relays every stream, so a
stream's next token waits for as long as that parsing holds the loop. This script serves the
demo model (``kunlun-platform --demo``, fresh ``KUNLUN_HOME``), sends a few requests, takes
one worker's exposition and builds from it the daemon's exposition for ``N`` replicas (the
worker's series relabelled per replica, as the daemon does). Then, per ``N``, side by side in
one process:

* **before**: what ran on the loop until 2026-12-07: the workers' texts parsed and written
  out (``_relabelled``, ``generate_latest``), and the history's two reads of the result
  (``windows.read`` and ``view.parse``, each parsing the whole text);
* **after**: the history's :meth:`MetricsHistory.sample` and the scrape's ``_written`` as
  the daemon runs them now (one parse, in a thread).

Each reports the CPU milliseconds of the work and ``loop_stall_ms``: the longest time a task
that wakes every millisecond on the same loop waited beyond its sleep (median of the repeats).

Usage: ``python benchmarks/metrics_history.py [--replicas 1,4,16] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client import generate_latest

from kunlun.daemon.exposition import _Families, _relabelled, _written
from kunlun.telemetry.view import metric_families, parse
from kunlun.ui.history import MetricsHistory
from kunlun.ui.windows import scrape

sys.path.insert(0, str(Path(__file__).parent))
from serving import free_port, lean_run, requests, start_platform, wait_serving, worker_pid  # noqa: E402


def worker_exposition() -> str:
    """A real worker's ``/metrics`` after a few requests (the demo platform, started here)."""
    with tempfile.TemporaryDirectory(prefix="kunlun-metrics-") as home:
        port = free_port()
        platform = start_platform(Path(home), port)
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(wait_serving(url, "smollm2"))
            asyncio.run(lean_run(url, "smollm2", requests(8, (32, 64), (8, 16)), 8, {}))
            worker = psutil.Process(worker_pid(platform))
            listening = [
                c.laddr.port for c in worker.net_connections("tcp") if c.status == "LISTEN"
            ]
            return httpx.get(f"http://127.0.0.1:{listening[0]}/metrics").text
        finally:
            platform.terminate()
            platform.wait(60)


async def watched(work: Callable[[], Awaitable[Any]]) -> dict[str, float]:
    """``work()`` on this loop beside a task waking every millisecond: its CPU and the
    longest wait beyond a wake-up."""
    stalls: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            stalls.append(time.perf_counter() - before - 0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    cpu = time.process_time()
    await work()
    cpu = time.process_time() - cpu
    done.set()
    await task
    return {"cpu_ms": cpu * 1e3, "loop_stall_ms": max(stalls) * 1e3}


def measure(worker: str, replicas: int, repeats: int) -> dict[str, Any]:
    workers = [({"replica": f"r{i}", "model": "smollm2", "device": f"cpu:{i}"}, worker)
               for i in range(replicas)]  # fmt: skip
    daemon = generate_latest(_Families(_relabelled(workers))).decode()

    async def before() -> None:
        generate_latest(_Families(_relabelled(workers)))
        scrape(metric_families(daemon))  # the old windows.read(text): a parse of its own
        parse(daemon)

    async def after() -> None:
        await asyncio.to_thread(_written, [], workers)
        await history.sample()

    async def render() -> str:
        return daemon

    history = MetricsHistory(render, interval_s=5.0)
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for turn in range(repeats):
        for side in ("before", "after") if turn % 2 == 0 else ("after", "before"):
            runs[side].append(asyncio.run(watched(before if side == "before" else after)))
    out: dict[str, Any] = {"exposition_bytes": len(daemon)}
    for side, results in runs.items():
        out[side] = {k: round(statistics.median(r[k] for r in results), 2) for k in results[0]}
    out["stall_after_vs_before"] = round(
        out["after"]["loop_stall_ms"] / out["before"]["loop_stall_ms"], 3
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    worker = worker_exposition()
    report = {
        "worker_exposition_bytes": len(worker),
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
    }
    for n in (int(x) for x in args.replicas.split(",")):
        report[f"replicas_{n}"] = measure(worker, n, args.repeats)
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
