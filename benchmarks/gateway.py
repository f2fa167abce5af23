"""Gateway overhead: the same streaming workload through the gateway and to the worker.

Starts one engine worker (the served model, fp32, cpu) and, in its own process, a gateway app
built as the daemon builds its own (``daemon_entry``: request log, API-key check with one
key in force, so every request is verified, and the gateway's endpoints, in front of a
FastAPI app with the gateway's routes) over a replica set holding that worker, on uvloop. Then, from this process:

* TTFT: sequential streaming ``/v1/completions`` requests (short prompts, ``max_tokens``
  2), alternating gateway and direct; each adjacent pair gives one difference (gateway
  minus direct); ``ttft_p50_added_ms`` is the median of those differences. TTFT is the time
  from sending the request to the first chunk carrying text. The order inside a pair
  alternates, and prompts stay under one KV block so the prefix cache favours neither.
* Throughput: the same set of requests run with 16 concurrent streams, a round through the
  gateway then a round direct (the order alternating), several times;
  ``throughput_ratio_16_streams`` is the median over rounds of gateway output tokens/s over
  direct output tokens/s.

Prints one JSON object. ``--quick`` runs a smaller workload (for a smoke check).
Each phase has its own worker and gateway, each serving the model that phase needs:

* TTFT on a tiny seeded random model (:mod:`kunlun.engine.tiny`, with the demo's
  tokenizer): its engine time is a few milliseconds with little jitter, so 1000 paired
  differences pin the median down to about a tenth of a millisecond
  (``ttft_p50_added_ms_ci95``). With the demo model the engine's own TTFT varies by tens of
  milliseconds from request to request, too much to resolve one millisecond.
* Throughput on the demo model: what the gateway costs a real engine. With the tiny model
  the engine is about a hundred times faster than any real one, so relaying each token
  weighs far more against it on the two vCPUs the three processes share.

``--model tiny`` or ``--model demo`` runs both phases on that one model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

MODEL = "smollm2"
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The quick brown fox",
    "def fibonacci(n):",
    "My favourite colour is",
    "Water boils at",
    "The sun rises in the",
    "One, two, three,",
]
"""Short prompts (well under one 16-token KV block)."""
API_KEYS: dict[str, str] = {}
"""Base URL -> the key to send (the gateway's; the worker's endpoint takes none)."""
MAX_NUM_SEQS = 16
"""The worker's batch, and so the gateway's slots for its replica."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--num-threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--model", choices=("tiny", "demo"), default=None,
                        help="serve this model in both phases (default: TTFT on the tiny "
                             "model, throughput on the demo)")  # fmt: skip
    parser.add_argument("--pairs", type=int, default=None,
                        help="TTFT pairs (gateway, direct) in a full run, at least 250 "
                             "(default 1000 with the tiny model, 300 with the demo)")  # fmt: skip
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="throughput rounds (default 20 with the tiny model, 6 with the demo)",
    )
    parser.add_argument("--serve-gateway", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-url", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    return parser.parse_args()


# ---- the gateway process ----
def serve_gateway(worker_url: str, ready_file: str) -> None:
    import uvicorn
    from fastapi import FastAPI

    from kunlun.daemon.app import daemon_entry
    from kunlun.daemon.request_log import RequestLog
    from kunlun.serving.gateway import GatewayState, gateway_router
    from kunlun.serving.replica import Replica, ReplicaSet
    from kunlun.serving.worker import bind_socket, run_event_loop
    from kunlun.state.api_keys import KeyRing, create_key
    from kunlun.state.sqlite import SQLiteStore

    replicas, state = ReplicaSet(), GatewayState()
    replicas.upsert(Replica("r1", "w1", MODEL, "cpu:0", worker_url, ready=True,
                            max_num_seqs=MAX_NUM_SEQS))  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await state.start()
        yield
        await state.close()
        request_log.close()

    # as in the daemon: the gateway inside API-key checks (a key exists) and the request log
    folder = Path(ready_file).parent
    store = SQLiteStore(folder / "state.db")
    _, api_key = create_key(store, "benchmark")
    request_log = RequestLog(folder / "requests.jsonl")
    app = FastAPI(lifespan=lifespan)
    app.include_router(gateway_router(replicas, state))
    entry = daemon_entry(app, replicas, state, KeyRing(store), request_log)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(entry, log_level="warning", access_log=False))

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        ready = {"port": sock.getsockname()[1], "api_key": api_key}
        Path(ready_file).write_text(json.dumps(ready))
        await task

    run_event_loop(run())  # uvloop, as in the daemon


# ---- processes ----
def wait_ready(process: subprocess.Popen[bytes], path: Path, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + 600
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            log = path.with_suffix(".log")
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise SystemExit(f"{what} did not start (exit status {process.poll()})\n{tail}")
        time.sleep(0.1)
    time.sleep(0.05)  # the gateway writes non-atomically; the worker atomically
    return json.loads(path.read_text())


def model_dir(which: str, folder: Path) -> Path:
    """The served checkpoint: the imported demo, or a tiny random Llama with its tokenizer."""
    from kunlun.engine.gguf import demo_model_dir

    if which == "demo":
        return demo_model_dir()
    from kunlun.engine.tiny import build_tiny_model

    return build_tiny_model("LlamaForCausalLM", False, folder / "tiny", demo_model_dir())


def start_processes(
    folder: Path, num_threads: int, which: str
) -> tuple[list[subprocess.Popen[bytes]], str, str]:
    from kunlun.engine.launch import worker_command
    from kunlun.serving.worker import write_launch

    launch = write_launch(folder / "launch.json", model_dir(which, folder), MODEL,
                          ready_file=folder / "worker.json", max_num_seqs=MAX_NUM_SEQS,
                          kv_cache_memory_bytes=256 << 20, max_model_len=512,
                          num_threads=num_threads)  # fmt: skip
    command = worker_command(launch)
    log = (folder / "worker.log").open("wb")
    worker = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    direct = f"http://127.0.0.1:{wait_ready(worker, folder / 'worker.json', 'worker')['port']}"
    gateway_command = [sys.executable, __file__, "--serve-gateway", "--worker-url", direct,
                       "--ready-file", str(folder / "gateway.json")]  # fmt: skip
    gateway = subprocess.Popen(gateway_command)
    ready = wait_ready(gateway, folder / "gateway.json", "gateway")
    gateway_url = f"http://127.0.0.1:{ready['port']}"
    API_KEYS[gateway_url] = ready["api_key"]
    return [worker, gateway], gateway_url, direct


# ---- measurements ----
async def stream_once(client: httpx.AsyncClient, base_url: str, prompt: str, max_tokens: int,
                      request_id: str = "") -> tuple[float | None, int]:  # fmt: skip
    """One streaming completion: (seconds to the first text chunk, output tokens)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"X-Request-Id": request_id} if request_id else {}
    if base_url in API_KEYS:
        headers["Authorization"] = f"Bearer {API_KEYS[base_url]}"
    started = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{base_url}/v1/completions", json=body,
                             headers=headers) as response:  # fmt: skip
        if response.status_code != 200:
            raise SystemExit(f"{base_url}: HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event["choices"] and event["choices"][0]["text"]:
                ttft = time.perf_counter() - started
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft, tokens


async def measure_ttft(client: httpx.AsyncClient, gateway: str, direct: str, num_pairs: int,
                       folder: Path, gateway_pid: int) -> dict[str, Any]:  # fmt: skip
    gateway_ms, direct_ms, added = [], [], []
    ids: list[tuple[str, str]] = []
    cpu_before = process_cpu_s(gateway_pid)
    for i in range(num_pairs):
        prompt = PROMPTS[i % len(PROMPTS)]
        order = (gateway, direct) if i % 2 == 0 else (direct, gateway)
        times, pair = {}, {gateway: f"ttft-{i}-gateway", direct: f"ttft-{i}-direct"}
        for base_url in order:
            ttft, _ = await stream_once(client, base_url, prompt, 2, pair[base_url])
            times[base_url] = (ttft or float("nan")) * 1e3
        gateway_ms.append(times[gateway])
        direct_ms.append(times[direct])
        added.append(times[gateway] - times[direct])
        ids.append((pair[gateway], pair[direct]))
    cpu_after = process_cpu_s(gateway_pid)
    quartiles = statistics.quantiles(added, n=4)
    engine_ms = worker_ttfts(folder / "worker.log")
    outside = [
        (g - engine_ms[gid]) - (d - engine_ms[did])
        for g, d, (gid, did) in zip(gateway_ms, direct_ms, ids, strict=True)
        if gid in engine_ms and did in engine_ms
    ]
    cpu_ms = None
    if cpu_before is not None and cpu_after is not None:
        cpu_ms = round((cpu_after - cpu_before) * 1e3 / num_pairs, 3)
    return {
        "ttft_requests": 2 * num_pairs,
        "ttft_pairs": num_pairs,
        "ttft_p50_gateway_ms": round(statistics.median(gateway_ms), 3),
        "ttft_p50_direct_ms": round(statistics.median(direct_ms), 3),
        "ttft_p50_added_ms": round(statistics.median(added), 3),
        "ttft_added_ms_p25_p75": [round(quartiles[0], 3), round(quartiles[2], 3)],
        "ttft_p50_added_ms_ci95": median_ci95(added),
        "ttft_p50_added_ms_engine_time_removed": round(statistics.median(outside), 3)
        if outside
        else None,
        "ttft_p50_added_ms_engine_time_removed_ci95": median_ci95(outside) if outside else None,
        "gateway_cpu_ms_per_request": cpu_ms,
    }


def median_ci95(values: list[float], resamples: int = 2000) -> list[float]:
    """A 95 % bootstrap interval of the median of ``values`` (fixed seed): how precisely
    this run pins the figure down."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return [round(medians[int(0.025 * resamples)], 3), round(medians[int(0.975 * resamples)], 3)]


def worker_ttfts(log_path: Path) -> dict[str, float]:
    """Request id -> the worker's own time to first token (ms), from its request log."""
    found = {}
    for line in log_path.read_text(errors="replace").splitlines():
        match = re.match(r"Request (\S+): status=200 .* ttft_ms=([0-9.]+) ", line)
        if match:
            found[match[1]] = float(match[2])
    return found


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process ``pid`` (Linux), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_round(client: httpx.AsyncClient, base_url: str, num_requests: int,
                    concurrency: int, max_tokens: int) -> float:  # fmt: skip
    """Output tokens/s of ``num_requests`` streams, ``concurrency`` at a time."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with semaphore:
            return (await stream_once(client, base_url, PROMPTS[i % len(PROMPTS)], max_tokens))[1]

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(num_requests))))
    return tokens / (time.perf_counter() - started)


async def measure_throughput(client: httpx.AsyncClient, gateway: str, direct: str,
                             num_rounds: int, num_requests: int, max_tokens: int
                             ) -> dict[str, Any]:  # fmt: skip
    concurrency = 16
    gateway_tps, direct_tps, ratios = [], [], []
    for i in range(num_rounds):
        order = (gateway, direct) if i % 2 == 0 else (direct, gateway)
        rates = {}
        for base_url in order:
            rates[base_url] = await run_round(
                client, base_url, num_requests, concurrency, max_tokens
            )
        gateway_tps.append(round(rates[gateway], 2))
        direct_tps.append(round(rates[direct], 2))
        ratios.append(rates[gateway] / rates[direct])
    return {
        "throughput_ratio_16_streams": round(statistics.median(ratios), 4),
        "throughput_rounds": num_rounds,
        "throughput_requests_per_round": num_requests,
        "throughput_max_tokens": max_tokens,
        "throughput_gateway_tokens_per_s": gateway_tps,
        "throughput_direct_tokens_per_s": direct_tps,
        "throughput_ratios": [round(r, 4) for r in ratios],
    }


async def measure(gateway: str, direct: str, quick: bool, pairs: int | None,
                  rounds: int | None, folder: Path, gateway_pid: int) -> dict[str, Any]:  # fmt: skip
    """The TTFT phase (``pairs`` pairs) and the throughput phase (``rounds`` rounds); a
    phase given None is skipped."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    results: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=300, limits=limits, trust_env=False) as client:
        for base_url in (gateway, direct, gateway, direct):  # warm connections and caches
            await stream_once(client, base_url, PROMPTS[0], 2)
        if pairs is not None:
            num_pairs = 60 if quick else pairs
            results |= await measure_ttft(client, gateway, direct, num_pairs, folder, gateway_pid)
        if rounds is not None:
            results |= await measure_throughput(client, gateway, direct, 2 if quick else rounds,
                                                32 if quick else 48, 8 if quick else 16)  # fmt: skip
    return results


def run_phase(which: str, num_threads: int, quick: bool, pairs: int | None,
              rounds: int | None) -> dict[str, Any]:  # fmt: skip
    """Start a worker serving ``which`` and a gateway in front of it, measure, stop them."""
    with tempfile.TemporaryDirectory() as folder:
        processes, gateway, direct = start_processes(Path(folder), num_threads, which)
        try:
            return asyncio.run(
                measure(gateway, direct, quick, pairs, rounds, Path(folder), processes[1].pid)
            )
        finally:
            for process in reversed(processes):
                process.terminate()
            for process in processes:
                process.wait(60)


MODELS = {
    "tiny": "tiny random Llama (3 layers, hidden 64, demo tokenizer), fp32, cpu",
    "demo": f"{MODEL} (SmolLM2-135M-Instruct demo), fp32, cpu",
}


def main() -> None:
    args = parse_args()
    if args.serve_gateway:
        serve_gateway(args.worker_url, args.ready_file)
        return
    # by default TTFT on the tiny model, throughput on the demo (see the module docstring)
    ttft_model = args.model or "tiny"
    throughput_model = args.model or "demo"
    pairs = args.pairs if args.pairs is not None else 1000 if ttft_model == "tiny" else 300
    rounds = args.rounds if args.rounds is not None else 20 if throughput_model == "tiny" else 6
    if pairs < 250 or rounds < 1:
        raise SystemExit(f"--pairs {pairs} --rounds {rounds}: at least 250 pairs (500 requests) "
                         "and one round are needed")  # fmt: skip
    if ttft_model == throughput_model:
        results = run_phase(ttft_model, args.num_threads, args.quick, pairs, rounds)
    else:
        results = run_phase(ttft_model, args.num_threads, args.quick, pairs, None)
        results |= run_phase(throughput_model, args.num_threads, args.quick, None, rounds)
    added, ratio = results["ttft_p50_added_ms"], results["throughput_ratio_16_streams"]
    report = {
        "benchmark": "gateway",
        "ttft_model": MODELS[ttft_model],
        "throughput_model": MODELS[throughput_model],
        "endpoint": "POST /v1/completions, streaming",
        "direct_path": "worker endpoint",
        "quick": args.quick,
        "worker_num_threads": args.num_threads,
        "cpu_count": os.cpu_count(),
        **results,
        "targets": {"ttft_p50_added_ms_max": 1.0, "throughput_ratio_16_streams_min": 0.97},
        "meets_targets": added <= 1.0 and ratio >= 0.97,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
