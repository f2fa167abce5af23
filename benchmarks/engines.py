"""llama.cpp through Kunlun, llama.cpp alone, and Kunlun's own engine; prints one JSON object.

Three sides, in one run, on the demo model (SmolLM2-135M) and this machine's CPU:

* ``kunlun_llama_cpp`` (a): ``kunlun-platform`` started here with a fresh ``KUNLUN_HOME``
  (default settings; the demo imported with ``kunlun-cli model import-gguf --demo``) and a
  workload ``engine: llama.cpp, max_num_seqs: 16, max_model_len: 1024`` submitted with
  ``kunlun-cli workload submit``: the node agent starts ``llama-server`` (confined, at the
  workers' niceness: ``kunlun.node.confine``) on the GGUF its plan names (for the demo's
  ``fp32, quantization none`` plan, the unquantized export in the plan cache) and every
  request goes through the daemon's gateway.
* ``llama_cpp`` (b): the same ``llama-server`` binary started by this script, with the argv
  the agent ran (its workload log's ``engine: ...`` line, checked against the running
  process's command line), that process's environment and its niceness; only ``--port``
  differs. So the
  only difference between (a) and (b) is the gateway (and the daemon around it).
* ``kunlun_engine`` (c): a second workload in the same daemon, on the embedded engine with
  ``quantization: w8a16`` by default (``--quantization``), also ``max_num_seqs: 16``. The
  scheme is the int8 one the engine's own benchmark measured fastest on CPU
  (``docs/benchmarks.md``, "Quantized weights"): w4a16 reads fewer bytes but its int4 kernel
  is slower per byte, and w8a8 adds a per-token activation quantization to every layer.

Requests come from :mod:`kunlun.bench.load`: streamed ``/v1/completions`` of token-id prompts
(``--input-len`` 32 ids, fresh random ones for every run so no prefix or slot cache helps),
``max_tokens`` ``--output-len`` (64), ``ignore_eos`` (the gateway passes it to llama-server,
which honours it) and temperature 0; tokens are the servers' ``usage.completion_tokens``.
Sets: ``1`` (one stream: ``--single-requests`` requests one after another) and ``16`` (16
requests at once). Tokens/s counts every output token over the time from the first request
sent to the last stream ended (:func:`kunlun.bench.stats.summarize`).

The machine is noisy, so the sides take turns: ``--rounds`` rounds, each running every set on
every side, the order of the sides rotating from round to round. Each side's figure is its
median over the rounds; each ratio is the median over the rounds of that round's ratio (runs
adjacent in time). ``kunlun_llama_cpp_vs_llama_cpp`` is (a)/(b) (target >= 0.97: the gateway
must not cost throughput); ``kunlun_llama_cpp_vs_kunlun_engine`` is (a)/(c).

``health`` lists what the daemon did to its replicas during the measured rounds
(health-check ejections, restarts). A replica out of routing answers 503, so before each run
on a daemon side the script waits until that replica is back in routing (each run's
``waited_for_routing_s``): the runs measure serving, and the ejections are reported, not
folded into the figures. A 503 that still happens counts in ``num_errors``.

Usage: ``python benchmarks/engines.py [--rounds 5] [--quantization w8a16]``
(about 3 to 4 minutes on 2 vCPUs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.serving import cpu_steal_ticks, wait_serving  # noqa: E402
from tests.daemons import Daemon, free_port  # noqa: E402

from kunlun.bench import load  # noqa: E402
from kunlun.bench.stats import summarize  # noqa: E402
from kunlun.engine.quant import SCHEMES  # noqa: E402
from kunlun.engines.adapter import find_binary  # noqa: E402

SIDES = ("kunlun_llama_cpp", "llama_cpp", "kunlun_engine")
LLAMA_NAME = "smollm2-llama-cpp"
"""The served name of workload (a), and so llama-server's ``--alias`` in (a) and (b)."""
SPEC = "model: smollm2\nname: {name}\nmax_num_seqs: 16\nmax_model_len: 1024\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--single-requests", type=int, default=2,
                        help="requests in turn in the one-stream set")  # fmt: skip
    parser.add_argument("--quantization", choices=[s for s in SCHEMES if s != "none"],
                        default="w8a16", help="the embedded engine's scheme (side c)")  # fmt: skip
    return parser.parse_args()


# ---- the daemon and its two workloads ----
def start_daemon(home: Path, quantization: str) -> tuple[Daemon, dict[str, str]]:
    """A daemon on ``home`` with the demo imported and workloads (a) and (c) submitted;
    returns it and the workload ids by side."""
    daemon = Daemon(home, free_port())
    imported = daemon.cli("model", "import-gguf", "--demo", remote=False, timeout=600)
    if imported.returncode != 0:
        raise SystemExit(f"model import-gguf --demo failed:\n{imported.stderr}")
    daemon.start(wait_ready=False)
    specs = {
        "kunlun_llama_cpp": SPEC.format(name=LLAMA_NAME) + "engine: llama.cpp\n",
        "kunlun_engine": SPEC.format(name=f"smollm2-{quantization}")
        + f"quantization: {quantization}\n",
    }
    jobs = {}
    for side, text in specs.items():
        path = home / f"{side}.yaml"
        path.write_text(text)
        proc = daemon.cli("workload", "submit", "--file", str(path), "--json")
        if proc.returncode != 0:
            raise SystemExit(f"workload submit ({side}) failed:\n{proc.stderr}")
        jobs[side] = json.loads(proc.stdout)["workload_id"]
    return daemon, jobs


def engine_argv(daemon: Daemon, job: str) -> tuple[list[str], dict[str, str], int]:
    """The argv the node agent ran for ``job`` (its log's ``engine:`` line, the program found
    as the agent finds it), the running process's environment, and its pid."""
    lines = (daemon.home / "logs" / f"{job}.log").read_text().splitlines()
    logged = shlex.split(next(ln for ln in lines if ln.startswith("engine: "))[len("engine: ") :])
    if "--" in logged:  # the model file is made first (an unquantized GGUF), then exec'd
        logged = logged[logged.index("--") + 1 :]
    program = find_binary(logged[0]) or logged[0]
    pid = int(daemon.describe(job)["replicas"][0]["pid"])
    running = psutil.Process(pid)
    if running.cmdline() != [program, *logged[1:]]:
        raise SystemExit(f"the logged argv {logged} is not what runs: {running.cmdline()}")
    return [program, *logged[1:]], running.environ(), pid


def start_direct(
    argv: list[str], env: dict[str, str], nice: int, log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """Side (b): ``argv`` with its ``--port`` set to a free one, at niceness ``nice``."""
    port = free_port()
    argv = list(argv)
    argv[argv.index("--port") + 1] = str(port)
    added = nice - os.nice(0)
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.nice(added) and None)  # fmt: skip
    return proc, port


def wait_in_routing(daemon: Daemon, job: str, timeout_s: float = 120) -> float:
    """Wait until ``job``'s replica is not out of routing (its last ``ejected`` event has a
    ``restored`` after it); the seconds waited."""
    started = time.monotonic()
    while True:
        info = daemon.get(f"/api/v1/workloads/{job}").json()
        kinds = [e["kind"] for e in info["events"] if e["kind"] in ("ejected", "restored")]
        if not kinds or kinds[-1] == "restored" or time.monotonic() - started > timeout_s:
            return round(time.monotonic() - started, 2)
        time.sleep(0.5)


def health_events(daemon: Daemon, jobs: dict[str, str], since: float) -> dict[str, Any]:
    """Per daemon side: replica restarts, and the events other than state changes since
    ``since`` (wall clock)."""
    out = {}
    for side, job in jobs.items():
        info = daemon.describe(job)
        events = [f"{e['kind']}: {e['message']}" for e in info["events"]
                  if e["ts"] >= since and e["kind"] not in ("state",)]  # fmt: skip
        out[side] = {"restarts": info["replicas"][0]["restarts"], "events": events}
    return out


# ---- the runs ----
def one_run(target: load.Target, count: int, concurrency: int, output_len: int,
            input_len: int, seed: int) -> dict[str, Any]:  # fmt: skip
    prompts = load.make_prompts(count, input_len, seed)
    records = asyncio.run(load.closed_loop(target, prompts, concurrency, output_len))
    summary = summarize(records)
    return {key: summary[key] for key in ("output_tokens_per_s", "total_output_tokens",
                                          "duration_s", "num_errors", "errors")}  # fmt: skip


def seed_of(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def cpu_info() -> dict[str, Any]:
    text = Path("/proc/cpuinfo").read_text()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("flags\t\t", "").split()
    return {
        "model": fields.get("model name\t", "").strip() or platform.processor(),
        "count": os.cpu_count(),
        "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "f16c", "fma"))),
    }


def median_ratio(numerators: list[float], denominators: list[float]) -> dict[str, Any]:
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True) if n and d]
    return {"median": round(statistics.median(ratios), 3) if ratios else None,
            "rounds": [round(r, 3) for r in ratios]}  # fmt: skip


def main() -> None:
    args = parse_args()
    started_wall, steal_start = time.time(), cpu_steal_ticks()
    report: dict[str, Any] = {
        "command": "python benchmarks/engines.py " + shlex.join(sys.argv[1:]),
        "setup": {
            "cpu": cpu_info(),
            "load_average_before": [round(x, 2) for x in os.getloadavg()],
            "rounds": args.rounds,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "single_requests": args.single_requests,
            "quantization": args.quantization,
        },  # fmt: skip
    }
    sets = {"1": (args.single_requests, 1), "16": (16, 16)}
    with tempfile.TemporaryDirectory(prefix="kunlun-engines-") as folder:
        home = Path(folder)
        daemon, jobs = start_daemon(home, args.quantization)
        direct: subprocess.Popen[bytes] | None = None
        try:
            names = {"kunlun_llama_cpp": LLAMA_NAME,
                     "kunlun_engine": f"smollm2-{args.quantization}"}  # fmt: skip
            for name in names.values():
                asyncio.run(wait_serving(daemon.url, name))
            argv, env, pid = engine_argv(daemon, jobs["kunlun_llama_cpp"])
            direct, port = start_direct(argv, env, psutil.Process(pid).nice(),
                                        home / "llama-server-direct.log")  # fmt: skip
            asyncio.run(wait_serving(f"http://127.0.0.1:{port}", LLAMA_NAME))
            targets = {
                "kunlun_llama_cpp": load.Target(daemon.url, names["kunlun_llama_cpp"]),
                "llama_cpp": load.Target(f"http://127.0.0.1:{port}", LLAMA_NAME),
                "kunlun_engine": load.Target(daemon.url, names["kunlun_engine"]),
            }
            running = psutil.Process(pid)
            report["llama_server"] = {"argv": argv, "version": _version(argv[0]),
                                      "nice": running.nice(), "nice_direct": psutil.Process(
                                          direct.pid).nice(),
                                      "cpu_affinity": running.cpu_affinity()}  # fmt: skip
            report["plans"] = {side: daemon.describe(job)["placement"]["why"]
                               for side, job in jobs.items()}  # fmt: skip
            for side in SIDES:  # warm-up: one short run of each set
                for name, (count, concurrency) in sets.items():
                    one_run(targets[side], count, concurrency, 8, args.input_len,
                            seed_of("warm", side, name))  # fmt: skip
            measured_since = time.time()
            runs: dict[str, dict[str, list[dict[str, Any]]]] = {
                side: {name: [] for name in sets} for side in SIDES
            }
            for turn in range(args.rounds):
                order = SIDES[turn % 3 :] + SIDES[: turn % 3]
                for name, (count, concurrency) in sets.items():
                    for side in order:
                        waited = wait_in_routing(daemon, jobs[side]) if side in jobs else 0.0
                        run = one_run(targets[side], count, concurrency, args.output_len,
                                      args.input_len, seed_of(turn, side, name))  # fmt: skip
                        run["waited_for_routing_s"] = waited
                        runs[side][name].append(run)
                        print(f"round {turn} set {name} {side}: {run['output_tokens_per_s']} "
                              f"tok/s, load {os.getloadavg()[0]:.2f}", file=sys.stderr,
                              flush=True)  # fmt: skip
            report["health"] = health_events(daemon, jobs, measured_since)
            report["health"]["llama_cpp"] = {"restarts": int(direct.poll() is not None)}
            report["health"]["kunlun_llama_cpp"]["same_pid"] = (
                daemon.describe(jobs["kunlun_llama_cpp"])["replicas"][0]["pid"] == pid
            )
        finally:
            if direct is not None:
                direct.terminate()
                direct.wait(60)
            daemon.stop()
    report.update(_figures(runs, sets))
    steal, total = (a - b for a, b in zip(cpu_steal_ticks(), steal_start, strict=True))
    report["setup"]["cpu_steal_pct"] = round(100 * steal / max(total, 1), 1)
    report["setup"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    report["setup"]["wall_s"] = round(time.time() - started_wall, 1)
    json.dump(report, sys.stdout, indent=2)
    print()


def _figures(runs: dict[str, dict[str, list[dict[str, Any]]]],
             sets: dict[str, tuple[int, int]]) -> dict[str, Any]:  # fmt: skip
    rate = {side: {name: [r["output_tokens_per_s"] or 0.0 for r in runs[side][name]]
                   for name in sets} for side in SIDES}  # fmt: skip
    figures: dict[str, Any] = {
        "tokens_per_s": {side: {name: round(statistics.median(rate[side][name]), 2)
                                for name in sets} for side in SIDES},
        "kunlun_llama_cpp_vs_llama_cpp": {
            name: median_ratio(rate["kunlun_llama_cpp"][name], rate["llama_cpp"][name])
            for name in sets},
        "kunlun_llama_cpp_vs_kunlun_engine": {
            name: median_ratio(rate["kunlun_llama_cpp"][name], rate["kunlun_engine"][name])
            for name in sets},
        "runs": runs,
    }  # fmt: skip
    figures["num_errors"] = {side: sum(r["num_errors"] for name in sets for r in runs[side][name])
                             for side in SIDES}  # fmt: skip
    return figures


def _version(binary: str) -> str:
    proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    return next((ln for ln in (proc.stdout + proc.stderr).splitlines() if "version" in ln), "")


if __name__ == "__main__":
    main()
