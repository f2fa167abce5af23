"""What a ``kunlun-cli`` command costs: CPU seconds (user + system) and wall time per run.

A real daemon (``kunlun-platform``, nothing served) is started in a fresh ``KUNLUN_HOME`` on
a free loopback port; each command then runs ``--runs`` times (after one untimed run, which
writes the bytecode caches) as an operator types it, through the console script:

- ``--help``: the command list;
- ``workload list``: one request to the daemon (its endpoint found from the daemon's pid
  file, as on the daemon's host), a table printed;
- ``workload list --json``, ``version`` and ``workload submit --help`` (its options made from
  the workload spec), for comparison; and ``python -c pass``, the
  interpreter's own start-up on this machine, the floor under every command.

The CPU of a run is the child's ``ru_utime + ru_stime`` (``resource.getrusage`` on the
child, taken from ``os.wait4``), so other load on the machine does not count. Prints one
JSON object: per command the median and the max CPU and wall seconds, and ``budget_s``
(0.3 s of CPU, issue 33) with ``within`` for ``--help`` and ``workload list``.

Usage: ``python benchmarks/cli_startup.py [--runs 9]`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
BUDGET_S = 0.3
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "kunlun-cli --help": [str(BIN / "kunlun-cli"), "--help"],
    "kunlun-cli version": [str(BIN / "kunlun-cli"), "version"],
    "kunlun-cli workload list": [str(BIN / "kunlun-cli"), "workload", "list"],
    "kunlun-cli workload list --json": [str(BIN / "kunlun-cli"), "workload", "list", "--json"],
    "kunlun-cli workload submit --help": [str(BIN / "kunlun-cli"), "workload", "submit", "--help"],
}


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run; a failed run stops the benchmark."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        err = proc.stderr.read().decode() if proc.stderr else ""
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {err}")
    return usage.ru_utime + usage.ru_stime, wall


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUNLUN_")}
        env["KUNLUN_HOME"] = home
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # the untimed run writes them, as pip does
        port = free_port()
        daemon = subprocess.Popen([str(BIN / "kunlun-platform"), "--port", str(port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise SystemExit("the daemon did not answer within 60 s")
                time.sleep(0.1)
            results = {}
            for name, argv in COMMANDS.items():
                run_once(argv, env)  # bytecode caches
                cpu, wall = zip(*(run_once(argv, env) for _ in range(args.runs)), strict=True)
                results[name] = {
                    "cpu_s_median": round(statistics.median(cpu), 3),
                    "cpu_s_max": round(max(cpu), 3),
                    "wall_s_median": round(statistics.median(wall), 3),
                }
        finally:
            daemon.terminate()
            daemon.wait(30)
    within = {name: results[name]["cpu_s_median"] <= BUDGET_S
              for name in ("kunlun-cli --help", "kunlun-cli workload list")}  # fmt: skip
    print(json.dumps({"runs": args.runs, "budget_s": BUDGET_S, "within": within,
                      "commands": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
