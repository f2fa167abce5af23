"""Canary rollouts and health-check ejection on one real daemon (the demo model on cpu:0).

In this order:

1. ``bad_canary``: a rollout of workload ``chat`` whose canary is made to fail half of its
   requests (``faults: {error_rate: 0.5}``, the platform's fault injection), with the
   default gates (``--max-error-rate 0.1%``, ``--min-requests`` 3000, steps 10,25,50,100,
   ``--interval 5m``) under a steady load of ``--streams`` threads of short chats. Reports
   the seconds from ``rollout create`` to the canary's first step (it loads), from the first
   step to the rollback decision, and from ``rollout create`` to the canary workload
   STOPPED (full rollback); and how many requests reached the bad version (and how many of
   those failed).
2. ``good_canaries``: ``--good`` rollouts in a row of the same model (steps 50,100, so one
   gated step, ``--interval 2s``, ``--min-requests 20``, ``--max-error-rate 5%``, the
   default 5 % p95 limit), each under the same load; counts the false rollbacks (any end
   but PROMOTED) and the time each took.
3. ``ejection``: workload ``pair`` with two replicas, the daemon probing every
   ``--health-check-interval`` seconds; one replica's worker is SIGSTOPped: seconds until
   ``/metrics`` shows it ejected (``kunlun_replica_ejected`` 1), polled every 0.05 s; then
   SIGCONT, seconds until it is back. ``--ejections`` rounds.

Usage: ``python benchmarks/rollout.py [--good 20] [--workdir DIR]`` from the repository
root; prints one JSON object and writes it to ``benchmarks/results/rollout-DATE.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.daemons import Daemon, free_port  # noqa: E402
from tests.rollout.conftest import SPEC, wait_serving  # noqa: E402
from tests.rollout.rollout_load import ONE_THREAD, Load, create, wait_for  # noqa: E402

from kunlun import __version__  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--good", type=int, default=20, help="good canaries in a row")
    add("--streams", type=int, default=4, help="load threads")
    add("--health-check-interval", type=float, default=5.0, help="the daemon's (s)")
    add("--ejections", type=int, default=3, help="SIGSTOP / SIGCONT rounds")
    add("--workdir", type=Path, default=None, help="home and logs (default: a temporary dir)")
    add("--output", type=Path, default=None, help="the JSON file to write")
    return parser.parse_args()


def submit(daemon: Daemon, name: str, extra: str = "") -> str:
    spec = daemon.home / f"{name}.yaml"
    spec.write_text(SPEC.format(model="smollm2").replace("name: chat", f"name: {name}") + extra)
    proc = daemon.cli("workload", "submit", "--file", str(spec), "--json")
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    workload_id = str(json.loads(proc.stdout)["workload_id"])
    wait_serving(daemon, workload_id)
    return workload_id


def workload_state(daemon: Daemon, workload_id: str) -> str:
    return str(daemon.describe(workload_id)["state"])


def bad_canary(daemon: Daemon, streams: int) -> dict[str, Any]:
    with Load(daemon.url, "chat", concurrency=streams) as load:
        time.sleep(2.0)  # the load runs before the rollout starts
        begun = time.monotonic()
        made = create(daemon.url, workload="chat", model="smollm2",
                      overrides={"faults": {"error_rate": 0.5, "seed": 7}})  # fmt: skip
        started = wait_for(daemon.url, made["rollout_id"], ("PROGRESSING", "ROLLED_BACK"))
        first_step = time.monotonic()
        ended = wait_for(daemon.url, made["rollout_id"], ("ROLLED_BACK", "ABORTED", "PROMOTED"))
        decided = time.monotonic()
        while workload_state(daemon, made["canary_workload_id"]) != "STOPPED":
            time.sleep(0.05)
        stopped = time.monotonic()
        reached, failed = load.count("canary"), load.count("canary", 500)
    return {
        "state": ended["state"],
        "reason": ended["reason"],
        "canary_start_s": round(first_step - begun, 2),
        "first_step_to_rollback_s": round(decided - first_step, 2),
        "create_to_full_rollback_s": round(stopped - begun, 2),
        "step_to_full_rollback_s": round(stopped - first_step, 2),
        "requests_to_bad_version": reached,
        "failed_requests_of_bad_version": failed,
        "started_state": started["state"],
        "gates_at_rollback": ended["history"][-1]["gates"] if ended["history"] else [],
    }


def good_canaries(daemon: Daemon, count: int, streams: int) -> dict[str, Any]:
    outcomes = []
    for _ in range(count):
        begun = time.monotonic()
        with Load(daemon.url, "chat", concurrency=streams) as load:
            made = create(daemon.url, workload="chat", model="smollm2", steps="50",
                          interval_s="2s", min_requests=20, max_error_rate="5%")  # fmt: skip
            ended = wait_for(daemon.url, made["rollout_id"], timeout_s=900)
        gates = ended["history"][-1]["gates"] if ended["history"] else []
        outcomes.append({
            "state": ended["state"], "reason": ended["reason"],
            "seconds": round(time.monotonic() - begun, 1),
            "canary_requests": load.count("canary"), "baseline_requests": load.count("baseline"),
            "p95_e2e_change": _change(gates, "p95_e2e"), "p95_ttft_change": _change(gates, "p95_ttft"),
        })  # fmt: skip
    false = [o for o in outcomes if o["state"] != "PROMOTED"]
    return {
        "canaries": count,
        "false_rollbacks": len(false),
        "median_seconds": statistics.median(o["seconds"] for o in outcomes),
        "outcomes": outcomes,
    }


def _change(gates: list[dict[str, Any]], name: str) -> float | None:
    gate = next((g for g in gates if g["gate"] == name), None)
    if gate is None or not gate["canary"] or not gate["baseline"]:
        return None
    return round(gate["canary"] / gate["baseline"] - 1, 3)


_EJECTED = re.compile(r"^kunlun_replica_ejected\{([^}]*)\} (\S+)$", re.MULTILINE)


def ejected(daemon: Daemon, replica_id: str) -> bool:
    for labels, value in _EJECTED.findall(daemon.get("/metrics").text):
        if f'replica="{replica_id}"' in labels:
            return float(value) == 1.0
    return False


def ejection(daemon: Daemon, rounds: int) -> dict[str, Any]:
    workload_id = submit(daemon, "pair", "replicas: 2\n")
    replicas = daemon.describe(workload_id)["replicas"]
    while len([r for r in replicas if r["ready"]]) < 2:
        time.sleep(0.5)
        replicas = daemon.describe(workload_id)["replicas"]
    target = replicas[0]
    out = []
    for _ in range(rounds):
        time.sleep(3.0)
        os.kill(target["pid"], signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            while not ejected(daemon, target["replica_id"]):
                time.sleep(0.05)
            out_after = time.monotonic() - stopped
        finally:
            os.kill(target["pid"], signal.SIGCONT)
        resumed = time.monotonic()
        while ejected(daemon, target["replica_id"]):
            time.sleep(0.05)
        out.append({"eject_s": round(out_after, 2), "back_s": round(time.monotonic() - resumed, 2)})
    return {"rounds": out, "eject_s_max": max(r["eject_s"] for r in out),
            "back_s_max": max(r["back_s"] for r in out)}  # fmt: skip


def run(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "scheduler_config.yaml").write_text("max_queue_wait_s: 600\n")
    (home / "device-plugin-config.yaml").write_text(ONE_THREAD)  # workers share the cores
    daemon = Daemon(home, free_port())
    imported = daemon.cli("model", "import-gguf", "--demo", remote=False, timeout=900)
    if imported.returncode != 0:
        raise SystemExit(imported.stderr)
    daemon.start("--health-check-interval", str(args.health_check_interval), wait_ready=False)
    try:
        submit(daemon, "chat")
        results: dict[str, Any] = {"bad_canary": bad_canary(daemon, args.streams)}
        results["good_canaries"] = good_canaries(daemon, args.good, args.streams)
        results["ejection"] = ejection(daemon, args.ejections)
        results["health_check_interval_s"] = args.health_check_interval
        return results
    finally:
        daemon.stop()


def main() -> None:
    args = parse_args()
    if args.workdir is not None:
        results = run(args.workdir.resolve(), args)
    else:
        with tempfile.TemporaryDirectory(prefix="kunlun-rollout-bench-") as folder:
            results = run(Path(folder), args)
    report = {
        "benchmark": "rollout",
        "date": datetime.date.today().isoformat(),
        "kunlun": __version__,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "summary": {
            "bad_canary_create_to_full_rollback_s": results["bad_canary"]["create_to_full_rollback_s"],
            "bad_canary_first_step_to_rollback_s": results["bad_canary"]["first_step_to_rollback_s"],
            "requests_to_bad_version": results["bad_canary"]["requests_to_bad_version"],
            "false_rollbacks": f"{results['good_canaries']['false_rollbacks']}/{args.good}",
            "eject_stopped_replica_s_max": results["ejection"]["eject_s_max"],
            "health_check_interval_s": args.health_check_interval,
        },
        **results,
    }  # fmt: skip
    output = args.output or ROOT / "benchmarks" / "results" / f"rollout-{report['date']}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
