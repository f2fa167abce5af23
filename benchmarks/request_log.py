"""What the request log costs the thread that serves requests.

The daemon's :class:`RequestLog` queues each entry and a writer thread encodes, writes and
fsyncs them in batches. This times ``RequestLog.write`` on the calling thread (what the
event loop pays per request) against a line-buffered synchronous append of the JSON line
(one ``write`` per request on the caller, no fsync: what the daemon did before), and reports
how long ``close`` takes to write what is still queued. The entries are built beforehand, and
the writer thread encodes batches while the loop runs: the worst case for the caller. Each figure is the median of ``--repeats`` timings of
``--calls`` entries, in microseconds per entry, written to a temporary folder.

Usage: ``python benchmarks/request_log.py [--calls N] [--repeats N]``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kunlun.daemon.request_log import RequestLog, RequestLogConfig


def entry(n: int) -> dict[str, Any]:
    return {
        "ts": round(time.time(), 3),
        "request_id": f"bench:{n}:1",
        "method": "POST",
        "path": "/v1/chat/completions",
        "model": "smollm2",
        "status": 200,
        "latency_ms": 12.34,
    }


def synchronous(path: Path, entries: list[dict[str, Any]]) -> float:
    """Seconds per entry of a line-buffered append on the caller's thread."""
    with path.open("a", encoding="utf-8", buffering=1) as handle:
        started = time.perf_counter()
        for e in entries:
            handle.write(json.dumps(e, ensure_ascii=False) + "\n")
        return (time.perf_counter() - started) / len(entries)


def queued(path: Path, entries: list[dict[str, Any]]) -> tuple[float, float]:
    """Seconds per entry of ``RequestLog.write`` (the writer thread busy meanwhile), and
    seconds ``close`` took to write the rest."""
    log = RequestLog(path, RequestLogConfig())
    started = time.perf_counter()
    for e in entries:
        log.write(e)
    per_entry = (time.perf_counter() - started) / len(entries)
    closing = time.perf_counter()
    log.close()
    assert log.num_written == len(entries) and log.num_dropped == 0
    return per_entry, time.perf_counter() - closing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    sync_s: list[float] = []
    write_s: list[float] = []
    close_s: list[float] = []
    entries = [entry(n) for n in range(args.calls)]
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            sync_s.append(synchronous(Path(tmp) / f"sync-{repeat}.jsonl", entries))
            per_entry, closing = queued(Path(tmp) / f"queued-{repeat}.jsonl", entries)
            write_s.append(per_entry)
            close_s.append(closing)
    print(
        json.dumps(
            {
                "benchmark": "request_log",
                "calls": args.calls,
                "repeats": args.repeats,
                "synchronous_write_us": round(statistics.median(sync_s) * 1e6, 2),
                "queued_write_us": round(statistics.median(write_s) * 1e6, 2),
                "close_ms": round(statistics.median(close_s) * 1e3, 1),
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
