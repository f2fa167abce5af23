"""How fast the ``/ui`` pages load in a real browser on a loaded node: 100 workloads, 64 devices.

One real daemon replays a 64-device node (``cpu:0`` and 63 H100s: the recorded 8 x H100
server of ``tests/fixtures/nodes`` repeated as boards, :mod:`tests.daemon.big_node`) with an
admin key. Through its API it gets 100 workloads: the demo model serving on ``cpu:0`` and 99
more placed on the GPUs (each placed, launched and stopped at once: the GPUs are replayed,
nothing could run there), so the store holds 100 real records with their placements and
events. A batch job and a few chat requests give the Batches and Metrics pages data; a real
``kunlun-cli validate --only api.sse`` and a small ``kunlun-cli bench`` written under
``KUNLUN_HOME/reports`` give the Validation and Bench pages theirs.

Debian's chromium (through Playwright) logs in with the key, visits every page once
(untimed), then opens each page ``--runs`` times: ``load_ms`` is the navigation's ``loadEventEnd``, ``drawn_ms`` the time from the start
of the navigation until the page's data is on screen (its rows, its heat map, its first chart
line). Prints one JSON object with the medians and writes it to
``benchmarks/results/dashboard-DATE.json``. Target: every page under 1 s.

Usage: ``python benchmarks/dashboard.py [--runs 7] [--workdir DIR]`` from the repository root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.daemon.big_node import write_node  # noqa: E402
from tests.daemons import BIN, ONE_THREAD, Daemon, free_port, wait_ready  # noqa: E402

from kunlun import __version__  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
GPUS = 63
WORKLOADS = 100
PAGES: dict[str, str] = {
    "devices": "document.querySelectorAll('#devices tr[data-device]').length >= 64"
    " && document.querySelectorAll('.heatmap td[data-d]').length > 0",
    "workloads": "document.querySelectorAll('#workloads tr[data-name]').length >= 100",
    "workload": "document.querySelectorAll('#events tr').length > 1",
    "metrics": "document.querySelectorAll('#chart-queue polyline').length > 0",
    "playground": "document.getElementById('model').options.length > 0",
    "batches": "document.querySelectorAll('#batches tr[data-batch]').length > 0",
    "validation": "document.querySelectorAll('#validation td .pass, #validation td .fail').length > 0",
    "bench": "document.querySelectorAll('#bench polyline').length > 0",
    "nodes": "document.querySelectorAll('#nodes tr[data-node]').length > 0",
    "rollouts": "document.querySelector('#rollouts, #no-rollouts') !== null",
}
"""Each page and the condition that says its data is drawn."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="loads of each page (median)")
    parser.add_argument("--workdir", type=Path, default=None, help="home (default: a temp dir)")
    parser.add_argument("--output", type=Path, default=None, help="the JSON file to write")
    return parser.parse_args()


def make_daemon(work: Path, started: list[Daemon]) -> tuple[Daemon, str, str]:
    """The daemon on the replayed node with an admin key, the demo serving on cpu:0 (added
    to ``started`` as soon as it runs: stopping it is the caller's)."""
    home = work / "home"
    home.mkdir(parents=True)
    env = dict(os.environ, KUNLUN_HOME=str(home))
    subprocess.run([str(BIN / "kunlun-cli"), "model", "import-gguf", "--demo"], env=env,
                   check=True, capture_output=True, timeout=900)  # fmt: skip
    (home / "device-plugin-config.yaml").write_text(ONE_THREAD)
    replay = write_node(work / "node", GPUS)
    daemon = Daemon(home, free_port())
    made = daemon.cli("apikey", "create", "ops", "--scope", "admin", "--json", remote=False)
    key = str(json.loads(made.stdout)["key"])
    daemon.start(wait_ready=False, extra_env={"KUNLUN_REPLAY_DIR": str(replay)})
    started.append(daemon)
    http = httpx.Client(base_url=daemon.url, headers={"authorization": f"Bearer {key}"},
                        timeout=120)  # fmt: skip
    demo = {"model": "smollm2", "device": "cpu:0", "max_num_seqs": 4,
            "max_model_len": 512, "kv_cache_memory_mb": 32}  # fmt: skip
    first = http.post("/api/v1/workloads", json=demo).raise_for_status().json()
    for i in range(WORKLOADS - 1):
        spec = {"model": "smollm2", "name": f"job-{i:03d}", "device": f"nvidia:{i % GPUS}"}
        made_w = http.post("/api/v1/workloads", json=spec).raise_for_status().json()
        http.post(f"/api/v1/workloads/{made_w['workload_id']}/stop").raise_for_status()
    wait_ready(daemon)
    for priority in ("high", "low"):
        http.post("/v1/chat/completions", headers={"x-kunlun-priority": priority},
                  json={"model": "smollm2", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "Hi"}]}).raise_for_status()  # fmt: skip
    line = {"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2", "max_tokens": 2,
                     "messages": [{"role": "user", "content": "Hi"}]}}  # fmt: skip
    upload = http.post("/v1/files", data={"purpose": "batch"},
                       files={"file": ("in.jsonl", json.dumps(line) + "\n")}).raise_for_status()  # fmt: skip
    http.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint":
                                   "/v1/chat/completions", "completion_window": "24h"})  # fmt: skip
    reports, url = home / "reports", daemon.url
    for argv in (["validate", "--endpoint", url, "--model", "smollm2", "--only", "api.sse",
                  "--out", str(reports / "validation-bench")],
                 ["bench", "--endpoint", url, "--model", "smollm2", "--concurrency", "1,2",
                  "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
                  "--out", str(reports / "bench-bench")]):  # fmt: skip
        done = daemon.cli(*argv, key=key, timeout=600)
        if done.returncode != 0:
            print(f"kunlun-cli {argv[0]}: {done.stderr[-400:]}", file=sys.stderr)
    return daemon, key, first["workload_id"]


def wait_drawn(page: Any, ready: str, timeout_s: float = 30) -> float:
    """``performance.now()`` once ``ready`` holds, polled from here: the pages' CSP forbids the
    ``eval`` that Playwright's ``wait_for_function`` runs in the page."""
    probe = f"({ready}) ? performance.now() : null"
    deadline = time.monotonic() + timeout_s
    while (now := page.evaluate(probe)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{page.url}: not drawn within {timeout_s} s: {ready}")
        time.sleep(0.005)
    return float(now)


def measure(daemon: Daemon, key: str, workload_id: str, runs: int) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    out: dict[str, Any] = {}
    with sync_playwright() as play:
        browser = play.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
        page.goto(daemon.url + "/ui/login")
        page.fill("input[name=key]", key)
        page.click("button[type=submit]")
        page.wait_for_url("**/ui/devices")
        for name in PAGES:  # one untimed visit each: the daemon's first calls warm its caches
            path = f"/ui/workloads/{workload_id}" if name == "workload" else f"/ui/{name}"
            page.goto(daemon.url + path, wait_until="load")
        for name, ready in PAGES.items():
            path = f"/ui/workloads/{workload_id}" if name == "workload" else f"/ui/{name}"
            loads, drawn = [], []
            for _ in range(runs):
                answer = page.goto(daemon.url + path, wait_until="load")
                if answer is None or answer.status == 404:
                    break
                try:
                    drawn.append(wait_drawn(page, ready))
                except TimeoutError as exc:
                    out[name] = {"error": str(exc)}
                    break
                loads.append(page.evaluate(
                    "performance.getEntriesByType('navigation')[0].loadEventEnd"))  # fmt: skip
            if not drawn:
                out.setdefault(name, {"skipped": "no such page"})
                continue
            out[name] = {
                "path": path.replace(workload_id, "WORKLOAD"),
                "load_ms": round(statistics.median(loads), 1),
                "drawn_ms": round(statistics.median(drawn), 1),
                "drawn_ms_max": round(max(drawn), 1),
                "runs": len(loads),
            }
        browser.close()
    return out


def main() -> None:
    args = parse_args()
    work = args.workdir.resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="kl-dash-"))
    started: list[Daemon] = []
    try:
        daemon, key, workload_id = make_daemon(work, started)
        load_before = os.getloadavg()[0]
        pages = measure(daemon, key, workload_id, args.runs)
        load_after = os.getloadavg()[0]
    finally:
        for daemon in started:
            daemon.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    measured = [p for p in pages.values() if "drawn_ms" in p]
    report = {
        "benchmark": "dashboard",
        "date": datetime.date.today().isoformat(),
        "kunlun": __version__,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "setup": {"devices": GPUS + 1, "workloads": WORKLOADS, "runs": args.runs,
                  "browser": CHROMIUM, "when": time.strftime("%H:%M UTC", time.gmtime()),
                  "load_average_1m": [round(load_before, 2), round(load_after, 2)]},
        "summary": {"slowest_drawn_ms": max(p["drawn_ms"] for p in measured),
                    "all_under_1s": all(p["drawn_ms_max"] < 1000 for p in measured)},
        "pages": pages,
    }  # fmt: skip
    output = args.output or ROOT / "benchmarks" / "results" / f"dashboard-{report['date']}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
