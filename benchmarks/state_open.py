"""What checking the state database at open costs; prints one JSON object.

Builds a state database the size a busy node reaches (``--events`` workload events,
``--batches`` Batch API jobs with their input and output files, ``--keys`` API keys, a
hundred workloads and models), then times, best of ``--repeats`` from a warm page cache:
``PRAGMA quick_check`` (what :class:`~kunlun.state.sqlite.SQLiteStore` runs at open),
``PRAGMA integrity_check`` (which also cross-checks every index against its table), and a
whole ``SQLiteStore`` open.

Usage: ``python benchmarks/state_open.py [--events 200000] [--batches 20000] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
import time
from pathlib import Path

from kunlun.state.sqlite import SQLiteStore
from kunlun.state.store import (
    ApiKeyRecord,
    BatchRecord,
    FileRecord,
    ModelRecord,
    WorkloadRecord,
)


def build(path: Path, num_events: int, num_batches: int, num_keys: int) -> None:
    store = SQLiteStore(path)
    now = time.time()
    for i in range(100):
        spec = {"model": f"model-{i}", "replicas": 2, "max_num_seqs": 8, "max_model_len": 4096}
        store.put_workload(WorkloadRecord(f"w{i:04d}", f"job-{i}", spec, "RUNNING", None, "cpu:0"))
        store.put_model(ModelRecord(f"model-{i}", f"/models/model-{i}", "gguf:/x.gguf", now))
    for i in range(num_keys):
        store.put_api_key(ApiKeyRecord(f"{i:08x}", f"key-{i}", "0" * 64, now))
    store._db.execute("BEGIN")  # bulk rows in one transaction (the store commits each)
    for i in range(num_events):
        message = f"replica r{i % 7} started (pid {10000 + i}) on cpu:0 after {i % 30} s"
        store._db.execute(
            "INSERT INTO events (workload_id, ts, kind, message) VALUES (?,?,?,?)",
            (f"w{i % 100:04d}", now + i, "started", message),
        )
    store._db.execute("COMMIT")
    for i in range(num_batches):
        for suffix in ("in", "out"):
            store.put_file(FileRecord(f"file-{i}-{suffix}", f"{suffix}.jsonl", "batch", 4096, i))
        counts = {"total": 100, "completed": 100, "failed": 0}
        store.put_batch(
            BatchRecord(
                f"batch_{i:08d}", "/v1/chat/completions", f"file-{i}-in", "24h", "completed",
                i, i + 86400, counts, f"file-{i}-out", model="smollm2",
                usage={"prompt_tokens": 1234, "completion_tokens": 5678, "total_tokens": 6912},
            )
        )  # fmt: skip
    store.close()


def best(repeats: int, run: object) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return min(times)


def pragma(path: Path, name: str) -> None:
    db = sqlite3.connect(path)
    try:
        assert db.execute(f"PRAGMA {name}").fetchall() == [("ok",)]
    finally:
        db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.db"
        build(path, args.events, args.batches, args.keys)
        size = path.stat().st_size
        result = {
            "db_mib": round(size / 2**20, 1),
            "events": args.events,
            "batches": args.batches,
            "files": 2 * args.batches,
            "keys": args.keys,
            "quick_check_ms": round(
                1000 * best(args.repeats, lambda: pragma(path, "quick_check")), 1
            ),
            "integrity_check_ms": round(
                1000 * best(args.repeats, lambda: pragma(path, "integrity_check")), 1
            ),
            "store_open_ms": round(1000 * best(args.repeats, lambda: SQLiteStore(path).close()), 1),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
