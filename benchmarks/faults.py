"""Figures for two faults against a real daemon serving the demo model; prints one JSON object.

- ``long_prompts``: a stream (1,000 tokens) runs while a 10 MB prompt, then a 320 KB one
  (under the early-refusal bound at ``max_model_len`` 2048), is sent: the time to answer
  each, and the longest gap between two chunks of the stream in the second before and while
  each was handled. Before the early refusal and off-loop tokenizing, the worker's event
  loop stopped for the whole tokenization of the 10 MB prompt.
- ``stopped_worker``: the worker is stopped (SIGSTOP) and a request sent: the time until it
  is answered (504), until ``/readyz`` says 503, and until a restarted worker is ready.

Usage: ``python benchmarks/faults.py [--models-home DIR] [--answer-deadline-s S] [--no-stop]``,
where ``DIR`` is a ``KUNLUN_HOME`` with the demo model imported (default: imported into a
fresh one). Run it with ``PYTHONPATH=<other>/src`` to measure another checkout's code
(``--no-stop`` for code without liveness probes, where the stopped worker's request hangs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent
SPEC = "model: smollm2\nmax_num_seqs: 8\nmax_model_len: 2048\nkv_cache_memory_mb: 96\n"


def start_daemon(models_home: Path, *flags: str) -> tuple[subprocess.Popen[bytes], str, str]:
    home = Path(tempfile.mkdtemp(prefix="kunlun-faults-"))
    shutil.copy(models_home / "state.db", home / "state.db")
    (home / "models").symlink_to(models_home / "models")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, KUNLUN_HOME=str(home))
    log = (home / "daemon.log").open("wb")
    daemon = subprocess.Popen([str(BIN / "kunlun-platform"), "--port", str(port), *flags],
                              env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    while not _answers(url + "/healthz"):
        time.sleep(0.2)
    (home / "spec.yaml").write_text(SPEC)
    out = subprocess.run([str(BIN / "kunlun-cli"), "workload", "submit", "--file",
                          str(home / "spec.yaml"), "--json"], env=dict(env, KUNLUN_ENDPOINT=url),
                         capture_output=True, text=True, check=True)  # fmt: skip
    while not _answers(url + "/readyz"):
        time.sleep(0.2)
    return daemon, url, json.loads(out.stdout)["workload_id"]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _stream(url: str, times: list[float]) -> None:
    body = {"model": "smollm2", "prompt": "Count slowly:", "max_tokens": 1000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as response:
        for line in response.iter_lines():
            if line:
                times.append(time.perf_counter())


def stall(url: str, prompt: str) -> dict[str, Any]:
    """Answer time of ``prompt`` and the longest chunk gap of a concurrent stream (ms)."""
    times: list[float] = []
    streaming = threading.Thread(target=_stream, args=(url, times))
    streaming.start()
    while len(times) < 20:
        time.sleep(0.01)
    time.sleep(1.0)
    before = [b - a for a, b in zip(times, times[1:], strict=False)]
    sent = time.perf_counter()
    answer = httpx.post(url + "/v1/completions", timeout=900,
                        json={"model": "smollm2", "prompt": prompt, "max_tokens": 4})  # fmt: skip
    answered = time.perf_counter()
    time.sleep(1.0)
    during = [b - a for a, b in zip(times, times[1:], strict=False)
              if b >= sent and a <= answered + 0.5]  # fmt: skip
    streaming.join()
    return {"prompt_bytes": len(prompt.encode()), "status": answer.status_code,
            "answer_s": round(answered - sent, 2),
            "stream_max_gap_before_ms": round(max(before) * 1e3),
            "stream_max_gap_during_ms": round(max(during or [0.0]) * 1e3)}  # fmt: skip


def stopped_worker(url: str, home_job: str) -> dict[str, Any]:
    """Stop the worker; when its request is answered, /readyz says 503, a new one is ready."""
    described = subprocess.run(
        [str(BIN / "kunlun-cli"), "workload", "describe", home_job, "--json"],
        env=dict(os.environ, KUNLUN_ENDPOINT=url), capture_output=True, text=True, check=True,
    )  # fmt: skip
    pid = int(json.loads(described.stdout)["replicas"][0]["pid"])
    body = {"model": "smollm2", "prompt": "hi", "max_tokens": 2}
    httpx.post(url + "/v1/completions", json=body, timeout=300)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.perf_counter()
    answer = httpx.post(url + "/v1/completions", json=body, timeout=900)
    answered = time.perf_counter() - stopped
    while _answers(url + "/readyz"):
        time.sleep(0.05)
    not_ready = time.perf_counter() - stopped
    while not _answers(url + "/readyz"):
        time.sleep(0.1)
    return {"status": answer.status_code, "code": answer.json().get("error", {}).get("code"),
            "answered_s": round(answered, 2), "readyz_503_s": round(not_ready, 2),
            "ready_again_s": round(time.perf_counter() - stopped, 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models-home", type=Path, default=None)
    parser.add_argument("--answer-deadline-s", type=float, default=None)
    parser.add_argument(
        "--no-stop",
        action="store_true",
        help="skip stopped_worker (code without liveness probes hangs there)",
    )
    args = parser.parse_args()
    models_home = args.models_home
    if models_home is None:
        models_home = Path(tempfile.mkdtemp(prefix="kunlun-faults-models-"))
        subprocess.run([str(BIN / "kunlun-cli"), "model", "import-gguf", "--demo"], check=True,
                       env=dict(os.environ, KUNLUN_HOME=str(models_home)))  # fmt: skip
    flags = [] if args.answer_deadline_s is None else [
        "--worker-answer-deadline-s", str(args.answer_deadline_s)]  # fmt: skip
    daemon, url, job = start_daemon(models_home, *flags)
    try:
        words = " ".join(f"w{i % 977}" for i in range(300_000))
        result: dict[str, Any] = {
            "long_prompts": [stall(url, "a " * (5 << 20)), stall(url, words[:320_000])],
        }
        if not args.no_stop:
            result["stopped_worker"] = stopped_worker(url, job)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(120)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
