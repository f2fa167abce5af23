"""The platform against its own engine: end-to-end serving throughput; prints one JSON object.

Same machine, same run, same requests, the demo model with the plan the platform makes for it
on this machine's CPU (``place`` on the live inventory: dtype, ``max_num_seqs``, KV):

* **engine**: that plan's :class:`~kunlun.engine.engine_config.EngineConfig` in this process,
  requests added at once and stepped to the end (no HTTP, no detokenized text sent anywhere);
* **platform**: ``kunlun-platform --demo`` started here with a fresh ``KUNLUN_HOME`` and
  default settings, the same requests sent at once through the gateway (streaming
  completions of token-id prompts, ``ignore_eos`` so every request runs to its
  ``max_tokens``) by the client ``--client`` names: ``lean`` (the default: the gateway's own
  client to its workers, ``UpstreamPool``, the body's pieces counted as they arrive and only
  the closing usage event read, about a tenth of the SDK's CPU per token) or ``sdk``
  (the ``openai`` SDK, which decodes every event into its objects). On a machine whose every
  core runs the engine's step, the client's CPU is taken from the step, so the default is
  the client that takes least: the SDK's own cost is measured, not the platform's;
* **llama.cpp** (``llama_cpp.server`` on the demo GGUF, same threads) when its server extra
  is installed; skipped, saying so, otherwise. Its server takes text prompts only (the same
  ids decoded, so its token counts may differ by a few) and has no ``ignore_eos`` (eos gets a
  logit bias of -100 instead); it serves one request at a time (``--interrupt_requests
  False``: by default a new request interrupts the one being generated). One round per set.

Sets: ``16`` (16 requests at once, 32-token prompts, 128 output tokens), ``1`` (one such
request alone) and ``mixed`` (32 requests, 16 at once, prompts 32-512, outputs 16-256).
Output tokens/s count every output token over the wall time from the first request sent to
the last token received; TTFT is per request, from sending it to its first token. This
machine's speed drifts (other tenants' load shows as CPU steal): the platform is started
first and idles while the engine runs, and the two sides take turns, round after round
(``1``: 8 rounds, ``16``: 9, ``mixed``: 6; who goes first alternates). Each
``platform_vs_engine_*`` is the median of the rounds' ratios (each ratio of two runs
adjacent in time); each side's figures are its best round, and ``rounds`` lists every ratio.

``worker_layout``: the single-stream set on the in-process engine stepped from a second
thread (how the worker ran before: weights loaded on the main thread, steps on the engine
thread, two OpenMP pools) against the same engine on the thread that built it (how the worker
runs now), and the ratio.

``--no-direct-streams``: the platform relays every stream through its gateway instead of
having its worker write it to the client's connection (``direct_streams`` in the JSON counts
the streams written directly: 0 then).

``--profile``: py-spy (when installed) samples the platform's worker during one more ``16``
run; ``profile`` gives each worker thread's share of the samples, the top functions by own
time, and each process's CPU use (cores) over that run.

Keys: ``platform_vs_engine_16``, ``platform_vs_engine_1``, ``platform_vs_engine_mixed``,
``ttft_p50_ms_16`` (the platform's), ``worker_layout``, ``cpu_steal_pct`` (the share of CPU
time the host took during the whole run), and each side's figures. ``cpu_ms_per_token``:
per set, the CPU milliseconds per output token of the worker, the daemon (the gateway) and
the client (this process) during the platform's rounds, each the median
of the rounds. On a machine whose every core runs the engine's step, the daemon's and the
client's share are taken from the step: it is what the platform costs beyond the engine
(the daemon's) and what measuring it costs (the client's).

Usage: ``python benchmarks/serving.py [--threads N] [--quick] [--profile] [--client lean|sdk]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import torch

from kunlun.device.inventory import build_inventory
from kunlun.device.registry import load_plugins
from kunlun.engine.gguf import demo_model_dir
from kunlun.engine.llm_engine import LLMEngine
from kunlun.engine.sampling_params import SamplingParams
from kunlun.engine.tokenizer import Tokenizer
from kunlun.http_client import UpstreamPool
from kunlun.planner.launch import engine_launch
from kunlun.planner.model_info import inspect_model
from kunlun.planner.plan import ExecutionPlan
from kunlun.workload.placement import place
from kunlun.workload.spec import WorkloadSpec

BIN = Path(sys.executable).parent
Request = tuple[list[int], int]


def requests(count: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
             seed: int = 0) -> list[Request]:  # fmt: skip
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_lens))],
         rng.randint(*output_lens))
        for _ in range(count)
    ]  # fmt: skip


def summary(started: float, ttfts: list[float], ends: list[float], tokens: int) -> dict[str, float]:
    elapsed = max(ends) - started
    return {
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
        "elapsed_s": round(elapsed, 2),
        "output_tokens": tokens,
    }


# ---- the engine, in this process ----
def engine_run(engine: LLMEngine, batch: list[Request], in_flight: int) -> dict[str, float]:
    """``batch`` with ``in_flight`` at once (a new one enters as one finishes)."""
    pending = list(batch)
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    ends: list[float] = []
    tokens = 0
    started = time.perf_counter()

    def add() -> None:
        prompt, num = pending.pop(0)
        params = SamplingParams(temperature=0, max_tokens=num, ignore_eos=True)
        sent[engine.add_request(prompt, params)] = time.perf_counter()

    for _ in range(min(in_flight, len(pending))):
        add()
    while engine.has_unfinished():
        for delta in engine.step():
            now = time.perf_counter()
            if delta.token_ids and delta.request_id not in first:
                first[delta.request_id] = now
            tokens += len(delta.token_ids)
            if delta.final is not None:
                ends.append(now)
                if pending:
                    add()
    ttfts = [first[r] - sent[r] for r in sent]
    return summary(started, ttfts, ends, tokens)


# ---- the platform, through the gateway ----
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_platform(home: Path, port: int, *flags: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, KUNLUN_HOME=str(home))
    log = (home / "platform.log").open("wb")
    return subprocess.Popen([str(BIN / "kunlun-platform"), "--demo", "--port", str(port),
                             *flags], env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


def direct_streams(url: str) -> int:
    """The streams the platform's worker wrote to the client's connection itself."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("kunlun_direct_streams_total{")))  # fmt: skip


async def wait_serving(url: str, model: str, timeout_s: float = 600) -> None:
    import openai

    deadline = time.monotonic() + timeout_s
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        while True:
            try:
                await client.completions.create(model=model, prompt="Hello", max_tokens=1)
                return
            except Exception as exc:  # noqa: BLE001 - not up yet: connection refused, 503
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not serve {model}: {exc}") from exc
                await asyncio.sleep(1)


async def client_run(url: str, model: str, batch: list[tuple[Any, int]], in_flight: int,
                     extra: dict[str, Any], count_chunks: bool = False) -> dict[str, float]:  # fmt: skip
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=900)  # fmt: skip
    gate = asyncio.Semaphore(in_flight)
    ttfts: list[float] = []
    ends: list[float] = []
    counted = [0]

    async def one(prompt: list[int] | str, num: int) -> None:
        async with gate:
            sent = time.perf_counter()
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=num, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=extra,
            )  # fmt: skip
            seen_first = False
            async for chunk in stream:
                if not seen_first and chunk.choices and chunk.choices[0].text:
                    ttfts.append(time.perf_counter() - sent)
                    seen_first = True
                if chunk.usage is not None:
                    counted[0] += chunk.usage.completion_tokens
                elif count_chunks and chunk.choices and chunk.choices[0].text:
                    counted[0] += 1  # a server that sends no usage: one token per chunk
            ends.append(time.perf_counter())

    started = time.perf_counter()
    await asyncio.gather(*(one(p, n) for p, n in batch))
    await client.close()
    return summary(started, ttfts, ends, counted[0])


_TEXT = re.compile(rb'"text":\s*"(?!")')
"""An event's choice with text (JSON escapes a quote inside the text; llama.cpp's Python
server writes a space after the colon, Kunlun none)."""
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_JSON = [(b"content-type", b"application/json")]


async def lean_run(url: str, model: str, batch: list[tuple[Any, int]], in_flight: int,
                   extra: dict[str, Any], count_chunks: bool = False) -> dict[str, float]:  # fmt: skip
    """:func:`client_run` with the gateway's own client to its workers for its client
    (:class:`~kunlun.http_client.UpstreamPool`: keep-alive connections, the ``httptools``
    parser): the answer's text is not decoded; its usage event (``count_chunks``: its events
    with text) gives its tokens."""
    pool = UpstreamPool()
    gate = asyncio.Semaphore(in_flight)
    ttfts: list[float] = []
    ends: list[float] = []
    counted = [0]

    async def one(prompt: list[int] | str, num: int) -> None:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": num,
                           "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}, **extra}).encode()  # fmt: skip
        async with gate:
            sent = time.perf_counter()
            seen_first, tail = False, b""
            response = await pool.post(url, "/v1/completions", _JSON, body)
            try:
                async for piece in response.iter_raw():
                    if not seen_first and _TEXT.search(piece):
                        ttfts.append(time.perf_counter() - sent)
                        seen_first = True
                    if count_chunks:
                        counted[0] += len(_TEXT.findall(piece))
                    tail = (tail + piece)[-4096:]
            finally:
                await response.close()
            ends.append(time.perf_counter())
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {tail[-300:]!r}")
        if not count_chunks:
            usage = _COMPLETION_TOKENS.findall(tail)
            if not usage:
                raise RuntimeError(f"{url}: a stream without its usage event: ...{tail[-200:]!r}")
            counted[0] += int(usage[-1])

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(p, n) for p, n in batch))
    finally:
        await pool.close()
    return summary(started, ttfts, ends, counted[0])


CLIENTS = {"lean": lean_run, "sdk": client_run}
"""The benchmark's clients: ``--client``."""


def start_llamacpp(port: int, threads: int) -> subprocess.Popen[bytes] | str:
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as exc:
        return f"llama_cpp.server is not installed ({exc.name}): pip install 'llama-cpp-python[server]'"
    from kunlun.engine.gguf import demo_gguf_path

    return subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(demo_gguf_path()),
         "--port", str(port), "--n_threads", str(threads), "--n_ctx", "8192",
         "--model_alias", "smollm2", "--interrupt_requests", "False"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


# ---- the run ----
def platform_plan() -> ExecutionPlan:
    """The plan ``kunlun-platform --demo`` makes for the demo workload on this machine."""
    model_dir = demo_model_dir()
    spec = WorkloadSpec(model="smollm2", device="cpu:0")
    return place(spec, build_inventory(), inspect_model(model_dir, "smollm2")).plans[0]


def cpu_steal_ticks() -> tuple[int, int]:
    """(steal, all) CPU ticks since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields[:8])


def with_cores(run: Any) -> dict[str, float]:
    """``run()``'s result with ``cores``: this process's CPU time over the wall time."""
    started, cpu = time.perf_counter(), time.process_time()
    result = dict(run())
    result["cores"] = round((time.process_time() - cpu) / (time.perf_counter() - started), 2)
    return result


def on_second_thread(engine: LLMEngine, batch: list[Request]) -> dict[str, float]:
    """:func:`engine_run` from a new thread (the engine was built on this one)."""
    result: list[dict[str, float]] = []
    thread = threading.Thread(target=lambda: result.append(engine_run(engine, batch, 1)))
    thread.start()
    thread.join()
    return result[0]


def with_cpu(run: Any, platform: subprocess.Popen[bytes]) -> dict[str, Any]:
    """``run()``'s result with ``cpu_ms_per_token`` of the worker, daemon and client."""
    import psutil

    processes = {"worker": psutil.Process(worker_pid(platform)),
                 "daemon": psutil.Process(platform.pid), "client": psutil.Process()}  # fmt: skip
    before = {name: sum(p.cpu_times()[:2]) for name, p in processes.items()}
    result = dict(run())
    tokens = max(result["output_tokens"], 1)
    result["cpu_ms_per_token"] = {
        name: round((sum(p.cpu_times()[:2]) - before[name]) * 1e3 / tokens, 3)
        for name, p in processes.items()
    }
    return result


def worker_pid(platform: subprocess.Popen[bytes]) -> int:
    import psutil

    for child in psutil.Process(platform.pid).children(recursive=True):
        if "kunlun.serving.worker" in " ".join(child.cmdline()):
            return child.pid
    raise RuntimeError("no worker process under the platform")


def profile_worker(url: str, platform: subprocess.Popen[bytes], batch: list[Request],
                   in_flight: int, client: Any) -> dict[str, Any]:  # fmt: skip
    """py-spy on the worker during one run of ``batch`` (see the module)."""
    import psutil

    spy = BIN / "py-spy"
    if not spy.exists():
        return {"skipped": "py-spy is not installed: pip install py-spy"}
    pid = worker_pid(platform)
    processes = {"worker": psutil.Process(pid), "daemon": psutil.Process(platform.pid),
                 "client": psutil.Process()}  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "worker.txt"
        recorder = subprocess.Popen([str(spy), "record", "--pid", str(pid), "--rate", "50",
                                     "--threads", "--format", "raw", "--output", str(raw),
                                     "--nonblocking"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(1)
        before = {name: sum(p.cpu_times()[:2]) for name, p in processes.items()}
        started = time.perf_counter()
        run = asyncio.run(client(url, "smollm2", batch, in_flight, {"ignore_eos": True}))
        wall = time.perf_counter() - started
        cores = {name: round((sum(p.cpu_times()[:2]) - before[name]) / wall, 2)
                 for name, p in processes.items()}  # fmt: skip
        recorder.send_signal(2)
        recorder.wait(60)
        threads: Counter[str] = Counter()
        leaves: Counter[str] = Counter()
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            threads[frames[0].split(" ")[0] + " " + _thread_role(stack)] += int(count)
            leaves[frames[-1]] += int(count)
    total = sum(threads.values()) or 1
    return {
        "run": run,
        "cores": cores,
        "samples": total,
        "threads_pct": {t: round(100 * n / total, 1) for t, n in threads.most_common()},
        "top_self_pct": {f: round(100 * n / total, 1) for f, n in leaves.most_common(8)},
    }


def _thread_role(stack: str) -> str:
    if "_run (kunlun/engine/async_engine.py" in stack:
        return "(engine thread)"
    if "run_event_loop (kunlun/serving/worker.py" in stack or "uvloop" in stack:
        return "(event loop)"
    return "(other)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    parser.add_argument("--profile", action="store_true", help="py-spy on the worker")
    parser.add_argument(
        "--no-direct-streams",
        action="store_true",
        help="the platform relays every stream through its gateway (kunlun-platform's flag)",
    )
    parser.add_argument(
        "--client",
        choices=sorted(CLIENTS),
        default="lean",
        help="the client of the platform and llama.cpp (default: lean)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    output = 16 if args.quick else 128
    sets = {
        "16": (requests(16, (32, 32), (output, output)), 16),
        "1": (requests(1, (32, 32), (output, output), seed=1), 1),
        "mixed": (requests(8 if args.quick else 32, (32, 512), (16, output), seed=2), 16),
    }
    rounds = {"16": 9, "1": 8, "mixed": 6}
    steal_start = cpu_steal_ticks()
    plan = platform_plan()
    report: dict[str, Any] = {"plan": plan.summary()}
    with tempfile.TemporaryDirectory(prefix="kunlun-serving-") as home:
        port = free_port()
        flags = ("--no-direct-streams",) if args.no_direct_streams else ()
        proc = start_platform(Path(home), port, *flags)  # loads while the engine below does
        url = f"http://127.0.0.1:{port}"
        try:
            launch = engine_launch(plan, load_plugins().plugins["cpu"], demo_model_dir(),
                                   "smollm2", None, args.threads)  # fmt: skip
            engine = LLMEngine(launch.engine_config())
            engine_run(engine, requests(2, (32, 32), (8, 8), seed=9), 2)  # warm-up
            asyncio.run(wait_serving(url, "smollm2"))
            ours: dict[str, list[dict[str, float]]] = {name: [] for name in sets}
            theirs: dict[str, list[dict[str, float]]] = {name: [] for name in sets}
            for name, (batch, in_flight) in sets.items():
                for turn in range(rounds[name]):
                    for side in ("engine", "platform") if turn % 2 == 0 else ("platform", "engine"):
                        if side == "engine":
                            ours[name].append(engine_run(engine, batch, in_flight))
                        else:
                            send = functools.partial(
                                CLIENTS[args.client],
                                url,
                                "smollm2",
                                batch,
                                in_flight,
                                {"ignore_eos": True},
                            )
                            run = functools.partial(asyncio.run, send())
                            theirs[name].append(with_cpu(run, proc))
                    print(f"{name}: engine {ours[name][-1]['output_tokens_per_s']}, platform "
                          f"{theirs[name][-1]['output_tokens_per_s']}", file=sys.stderr,
                          flush=True)  # fmt: skip
            one = sets["1"][0]
            layout = [(with_cores(functools.partial(on_second_thread, engine, one)),
                       with_cores(functools.partial(engine_run, engine, one, 1)))
                      for _ in range(3)]  # fmt: skip
            del engine
            report["direct_streams"] = direct_streams(url)
            if args.profile:
                report["profile"] = profile_worker(url, proc, *sets["16"], CLIENTS[args.client])
        finally:
            proc.terminate()
            proc.wait(60)
    best = {side: {name: max(runs, key=lambda r: r["output_tokens_per_s"])
                   for name, runs in results.items()}
            for side, results in (("engine", ours), ("platform", theirs))}  # fmt: skip
    report.update(best)
    report["rounds"] = {}
    for name in sets:
        ratios = [p["output_tokens_per_s"] / e["output_tokens_per_s"]
                  for e, p in zip(ours[name], theirs[name], strict=True)]  # fmt: skip
        report["rounds"][name] = [round(r, 3) for r in ratios]
        report[f"platform_vs_engine_{name}"] = round(statistics.median(ratios), 3)
    report["ttft_p50_ms_16"] = best["platform"]["16"]["ttft_p50_ms"]
    report["cpu_ms_per_token"] = {
        name: {part: round(statistics.median(r["cpu_ms_per_token"][part] for r in runs), 3)
               for part in ("worker", "daemon", "client")}
        for name, runs in theirs.items()
    }  # fmt: skip
    second = max((r[0] for r in layout), key=lambda r: r["output_tokens_per_s"])
    same = max((r[1] for r in layout), key=lambda r: r["output_tokens_per_s"])
    report["worker_layout"] = {
        "second_thread_tokens_per_s": second["output_tokens_per_s"],
        "second_thread_cores": second["cores"],
        "same_thread_tokens_per_s": same["output_tokens_per_s"],
        "same_thread_cores": same["cores"],
        "same_vs_second": round(same["output_tokens_per_s"] / second["output_tokens_per_s"], 3),
    }

    llama_port = free_port()
    server = start_llamacpp(llama_port, args.threads)
    if isinstance(server, str):
        report["llamacpp_skipped"] = server
    else:
        url = f"http://127.0.0.1:{llama_port}"
        try:
            asyncio.run(wait_serving(url, "smollm2"))
            # its server takes text prompts only (the same ids, decoded) and has no
            # ignore_eos (eos gets a logit bias of -100 instead)
            tokenizer = Tokenizer(demo_model_dir())
            eos = {str(t): -100 for t in tokenizer.eos_token_ids}
            llama = {}
            for name, (batch, in_flight) in sets.items():
                texts = [(tokenizer.decode(p), n) for p, n in batch]
                llama[name] = asyncio.run(CLIENTS[args.client](url, "smollm2", texts, in_flight,
                                                     {"logit_bias": eos}, count_chunks=True))  # fmt: skip
                print(f"llama.cpp {name}: {llama[name]}", file=sys.stderr, flush=True)
            report["llamacpp"] = llama
        finally:
            server.terminate()
            server.wait(60)
    steal, total = (a - b for a, b in zip(cpu_steal_ticks(), steal_start, strict=True))
    report["cpu_steal_pct"] = round(100 * steal / max(total, 1), 1)
    report["setup"] = {
        "threads": args.threads,
        "quick": args.quick,
        "client": args.client,
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
    }
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
