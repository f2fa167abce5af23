"""The engine worker process: one per replica, started by the node agent.

``python -m kunlun.serving.worker --model-dir DIR --served-name NAME [options]`` loads the
model into an :class:`LLMEngine`, runs one warm-up generation, then serves the OpenAI API
(:mod:`kunlun.serving.worker_app`) on loopback. Once it accepts connections it writes the
ready file atomically, as JSON::

    {"pid": 1234, "port": 41234, "load_time_s": 1.23, "warmup_ttft_ms": 45.6,
     "compile_time_s": 0.0}

and prints, for the node agent's log capture, ``Compilation Time: 0.00 s`` (the GGUF import
when ``--model-dir`` names a ``.gguf`` file, plus casting the weights to ``--dtype`` into
``--plan-dir`` on a plan's first start, quantizing them when ``--quantization`` asks, logged
as ``conversion: ...``; 0 otherwise),
``Load Time: 1.23 s``, ``First Token Latency: 45.6 ms``, then one line per finished request.
SIGTERM stops accepting connections, lets in-flight requests finish, and exits 0. A bad
argument or a model that cannot load prints the error and exits 2 (configuration) or 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from kunlun.engine.quant import GROUP_SIZES, SCHEMES

_DTYPES = ("fp32", "bf16", "fp16")
WORKER_NICE = 5
"""Scheduling niceness a worker gives itself (``--nice``; ``KUNLUN_WORKER_NICE`` sets the
default). Engine compute is bulk work; the daemon's gateway, admin API and telemetry are
short bursts on the request path. At +5 a gateway burst preempts engine threads on a busy
CPU rather than queueing behind them: on the 2-vCPU benchmark machine this took the
gateway's added time to first token from about 0.9 ms to 0.55 ms. Workers all run at the
same niceness, so it changes nothing between replicas; the daemon's own work is small."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kunlun-worker", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model-dir", required=True, help="HF model directory (or a .gguf file, imported once)"
    )
    parser.add_argument("--served-name", required=True, help="model name clients send")
    parser.add_argument(
        "--device", default="cpu:0", help="device from the device plugin, e.g. cpu:0, cuda:0, npu:1"
    )
    parser.add_argument("--dtype", choices=_DTYPES, default="fp32")
    parser.add_argument(
        "--quantization",
        "--quantize",
        choices=SCHEMES,
        default="none",
        help="weight quantization (a checkpoint already quantized keeps its own)",
    )
    parser.add_argument(
        "--group-size", type=int, choices=GROUP_SIZES, default=None, help="w4a16 group size"
    )
    parser.add_argument(
        "--max-num-seqs", type=_positive, default=64, help="most sequences in one engine step"
    )
    parser.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        help="longest prompt + output (default: the model's)",
    )
    parser.add_argument(
        "--kv-cache-memory-mb",
        type=_positive,
        default=None,
        help="KV cache size in MiB (default: the engine's)",
    )
    parser.add_argument("--num-threads", type=_positive, default=None, help="CPU threads for torch")
    parser.add_argument(
        "--nice",
        type=_nice,
        default=os.environ.get("KUNLUN_WORKER_NICE", str(WORKER_NICE)),
        help=f"scheduling niceness, 0-19 (default {WORKER_NICE}, or KUNLUN_WORKER_NICE)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument(
        "--ready-file", type=Path, default=None, help="where to write the ready JSON once serving"
    )
    parser.add_argument(
        "--plan-dir",
        type=Path,
        default=None,
        help="plan-cache entry: weights cast to --dtype are kept in (and reused from) DIR/weights",
    )
    parser.add_argument(
        "--sandbox",
        type=_sandbox,
        default=None,
        help="set by the node agent: the worker's confinement as WorkerSandbox JSON "
        "(kunlun.node.sandbox); absent when the worker is started by hand",
    )
    parser.add_argument(
        "--trace-prefix",
        default=None,
        help="advanced profiling: write a Chrome trace of engine steps to PREFIX.<pid>.trace.json",
    )
    parser.add_argument(
        "--profiling-interval-ms",
        type=_non_negative,
        default=50.0,
        help="with --trace-prefix: trace at most one step per interval (0: every step)",
    )
    return parser.parse_args(argv)  # fmt: skip


def worker_command(
    model_dir: str | Path,
    served_name: str,
    *,
    ready_file: str | Path,
    device: str = "cpu:0",
    dtype: str = "fp32",
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    kv_cache_memory_mb: int | None = None,
    num_threads: int | None = None,
    port: int = 0,
) -> list[str]:
    """The command line that starts a worker with these settings (this interpreter)."""
    command = [sys.executable, "-m", "kunlun.serving.worker", "--model-dir", str(model_dir),
               "--served-name", served_name, "--device", device, "--dtype", dtype,
               "--port", str(port), "--ready-file", str(ready_file)]  # fmt: skip
    optional = {"--max-num-seqs": max_num_seqs, "--max-model-len": max_model_len,
                "--kv-cache-memory-mb": kv_cache_memory_mb, "--num-threads": num_threads}  # fmt: skip
    for flag, value in optional.items():
        if value is not None:
            command += [flag, str(value)]
    return command


def read_ready_file(path: str | Path) -> dict[str, Any] | None:
    """The ready JSON a worker wrote, or None while it is not there yet."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _nice(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(
            f"niceness (--nice or KUNLUN_WORKER_NICE) must be an integer 0-19, got {text!r}"
        )
    return value


def _sandbox(text: str) -> Any:
    from kunlun.node.sandbox import WorkerSandbox

    try:
        return WorkerSandbox.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} is not >= 0")
    return value


def say(line: str) -> None:
    """One log line to stdout, flushed at once (the node agent reads it live)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def torch_device(device: str) -> str:
    """``cpu:0`` -> ``cpu`` (torch has one cpu device); others pass through."""
    return "cpu" if device.split(":", 1)[0] == "cpu" else device


def build_engine(args: argparse.Namespace) -> tuple[Any, float, float]:
    """The :class:`AsyncLLMEngine` for ``args``, its compile (import) and load times."""
    import torch

    from kunlun.engine.async_engine import AsyncLLMEngine
    from kunlun.engine.device import resolve_device
    from kunlun.engine.llm_engine import LLMEngine

    started = time.perf_counter()
    model_dir = Path(args.model_dir)
    if model_dir.suffix == ".gguf" and model_dir.is_file():
        from kunlun.engine.gguf import import_gguf
        from kunlun.paths import model_cache_dir

        model_dir = import_gguf(model_dir, model_cache_dir() / model_dir.stem)
    if args.plan_dir is not None:
        from kunlun.engine.convert import prepare_weights

        model_dir, line = prepare_weights(
            model_dir, args.plan_dir / "weights", args.dtype, args.quantization, args.group_size
        )
        say(line)
    compile_time = time.perf_counter() - started
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    kv_bytes = None if args.kv_cache_memory_mb is None else args.kv_cache_memory_mb << 20
    started = time.perf_counter()
    engine = LLMEngine.from_model(
        model_dir,
        device=str(resolve_device(torch_device(args.device))),
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=kv_bytes,
        num_threads=args.num_threads,
        quantization=args.quantization,
        group_size=args.group_size,
    )
    return AsyncLLMEngine(engine), compile_time, time.perf_counter() - started


async def warm_up(engine: Any) -> float:
    """Run one short generation; return its time to first token in ms."""
    from kunlun.engine.sampling_params import SamplingParams

    started = time.perf_counter()
    ttft = None
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    async for delta in engine.add_request("Hello", params):
        if ttft is None and delta.token_ids:
            ttft = (time.perf_counter() - started) * 1e3
    return ttft or 0.0


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket for uvicorn's ``sockets=`` (``port`` 0 picks a free one).

    Made with an explicit ``IPPROTO_TCP``: asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on such sockets, and without that a response sent in two writes
    (headers, then body) waits for the peer's delayed ACK, about 40 ms per request.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def write_ready_file(path: Path, info: dict[str, Any]) -> None:
    """Write ``info`` as JSON to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(info))
    os.replace(temporary, path)


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from kunlun.serving.worker_app import create_worker_app

    engine, compile_time, load_time = build_engine(args)
    say(f"Compilation Time: {compile_time:.2f} s")
    say(f"Load Time: {load_time:.2f} s")
    engine.start()
    ttft_ms = await warm_up(engine)
    say(f"First Token Latency: {ttft_ms:.1f} ms")
    profiler = start_profiler(engine, args)
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    app = create_worker_app(engine, args.served_name, say)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=30)  # fmt: skip
    server = uvicorn.Server(config)
    # uvicorn re-raises the SIGTERM it handled once drained: make that a no-op, so the
    # worker shuts the engine down and exits 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        info = {"pid": os.getpid(), "port": port, "load_time_s": round(load_time, 3),
                "warmup_ttft_ms": round(ttft_ms, 1), "compile_time_s": round(compile_time, 3)}  # fmt: skip
        if args.ready_file is not None:
            write_ready_file(args.ready_file, info)
        say(f"Serving {args.served_name} on http://{args.host}:{port}")
    try:
        await task
    finally:
        await asyncio.to_thread(engine.shutdown)
        if profiler is not None:
            profiler.close()


def start_profiler(engine: Any, args: argparse.Namespace) -> Any:
    """The engine's step profiler when ``--trace-prefix`` asks for one (after the warm-up,
    so the trace holds served requests only), else None."""
    if args.trace_prefix is None:
        return None
    from kunlun.engine.step_profiler import StepProfiler
    from kunlun.telemetry.spec import trace_path

    path = trace_path(args.trace_prefix, os.getpid())
    profiler = StepProfiler(path, args.profiling_interval_ms, name=args.served_name)
    engine.engine.set_profiler(profiler)
    say(f"Advanced profiling: engine steps traced to {path} "
        f"(at most one step per {args.profiling_interval_ms:g} ms)")  # fmt: skip
    return profiler


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop where it is installed, as uvicorn does for the daemon (a loop
    and transports written in C: less CPU per request on the worker's HTTP side)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def import_trusted_modules() -> None:
    """Import the engine and server code before the sandbox locks (importing reads many files
    and maps libraries; what the allow-list must permit is then only what serving needs)."""
    import torch  # noqa: F401
    import uvicorn  # noqa: F401

    import kunlun.engine.async_engine  # noqa: F401
    import kunlun.engine.llm_engine  # noqa: F401
    import kunlun.serving.worker_app  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    from kunlun.errors import KunlunError

    args = parse_args(argv)
    if args.sandbox is not None:
        from kunlun.node import sandbox

        sandbox.enter(args.sandbox)  # dies with the daemon; rlimits, no_new_privs
    if args.nice:
        os.nice(args.nice)  # first, so every thread started later (torch, engine) inherits it
    if args.sandbox is not None:
        import_trusted_modules()
        sandbox.lock(args.sandbox)  # the seccomp allow-list, before any model file is read
    try:
        run_event_loop(serve(args))
    except KunlunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
