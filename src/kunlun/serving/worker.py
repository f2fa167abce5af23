"""The engine worker process: one per replica, started by the node agent.

``python -m kunlun.serving.worker --launch FILE`` reads its launch, an
:class:`~kunlun.engine.launch.EngineLaunch` as JSON (model, device, engine settings, its own
settings; nothing else reaches a worker), loads the model into an :class:`LLMEngine`, runs one warm-up generation, then serves the OpenAI API
(:mod:`kunlun.serving.worker_app`) on loopback. Once it accepts connections it writes the
ready file atomically, as JSON::

    {"pid": 1234, "port": 41234, "load_time_s": 1.23, "warmup_ttft_ms": 45.6,
     "compile_time_s": 0.0}

and prints, for the node agent's log capture, ``Compilation Time: 0.00 s`` (the GGUF import
when ``model_dir`` names a ``.gguf`` file, plus casting the weights to ``dtype`` into
``plan_dir`` on a plan's first start, logged as ``conversion: ...``; 0 otherwise),
``Load Time: 1.23 s``, ``First Token Latency: 45.6 ms``, then one line per finished request.
SIGTERM stops accepting connections, lets in-flight requests finish, and exits 0. A bad
launch file (naming the field and value) or a model that cannot load prints the error and
exits 2 (configuration) or 1.
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kunlun.engine.launch import EngineLaunch

WORKER_NICE = 5
"""Scheduling niceness a worker gives itself (the launch's ``nice``; ``KUNLUN_WORKER_NICE``
sets the default). Engine compute is bulk work; the daemon's gateway, admin API and telemetry are
short bursts on the request path. At +5 a gateway burst preempts engine threads on a busy
CPU rather than queueing behind them: on the 2-vCPU benchmark machine this took the
gateway's added time to first token from about 0.9 ms to 0.55 ms. Workers all run at the
same niceness, so it changes nothing between replicas; the daemon's own work is small."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kunlun-worker", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--launch",
        type=Path,
        required=True,
        help="the launch file: an EngineLaunch as JSON (kunlun.engine.launch)",
    )
    return parser.parse_args(argv)


def worker_command(launch_file: str | Path) -> list[str]:
    """The command line that starts a worker from ``launch_file`` (this interpreter). The one
    place a worker's command line is spelled: the node agent, tests and benchmarks call it."""
    return [sys.executable, "-m", "kunlun.serving.worker", "--launch", str(launch_file)]


def write_launch(
    path: str | Path,
    model_dir: str | Path,
    served_name: str,
    *,
    device: str = "cpu",
    **settings: Any,
) -> Path:
    """Write the launch of a worker started by hand (tests, benchmarks) to ``path`` and return
    it: ``device`` is a torch device string, its type's facts (device type, extension module,
    distributed backend) come from its device plugin; ``settings`` are other
    :class:`EngineLaunch` fields."""
    from kunlun.device.registry import plugin_for_torch_device
    from kunlun.engine.launch import EngineLaunch, device_fields

    plugin = plugin_for_torch_device(device.split(":", 1)[0])
    facts = {"device": device} if plugin is None else device_fields(plugin, device)
    return EngineLaunch(model_dir=Path(model_dir), served_name=served_name, **facts,
                        **settings).write(path)  # fmt: skip


def read_ready_file(path: str | Path) -> dict[str, Any] | None:
    """The ready JSON a worker wrote, or None while it is not there yet."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def worker_nice(launch: EngineLaunch) -> int:
    """The launch's niceness, or ``KUNLUN_WORKER_NICE``, or :data:`WORKER_NICE`; a
    :class:`ConfigError` naming the variable when it is not an integer 0-19."""
    from kunlun.errors import ConfigError

    if launch.nice is not None:
        return launch.nice
    text = os.environ.get("KUNLUN_WORKER_NICE", str(WORKER_NICE))
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ConfigError(f"KUNLUN_WORKER_NICE must be an integer 0-19, got {text!r}")
    return value


def say(line: str) -> None:
    """One log line to stdout, flushed at once (the node agent reads it live)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def build_engine(launch: EngineLaunch) -> tuple[Any, float, float]:
    """The :class:`AsyncLLMEngine` for ``launch``, its compile (import) and load times."""
    from kunlun.engine.async_engine import AsyncLLMEngine
    from kunlun.engine.device import import_extension
    from kunlun.engine.llm_engine import LLMEngine

    started = time.perf_counter()
    model_dir = launch.model_dir
    if model_dir.suffix == ".gguf" and model_dir.is_file():
        from kunlun.engine.gguf import import_gguf
        from kunlun.paths import model_cache_dir

        model_dir = import_gguf(model_dir, model_cache_dir() / model_dir.stem)
    if launch.plan_dir is not None:
        from kunlun.engine.convert import prepare_weights

        model_dir, line = prepare_weights(model_dir, launch.plan_dir / "weights", launch.dtype)
        say(line)
    compile_time = time.perf_counter() - started
    started = time.perf_counter()
    import_extension(launch.torch_module, launch.device)
    engine = LLMEngine(launch.engine_config(model_dir))
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


async def serve(launch: EngineLaunch) -> None:
    import uvicorn

    from kunlun.serving.worker_app import create_worker_app

    engine, compile_time, load_time = build_engine(launch)
    say(f"Compilation Time: {compile_time:.2f} s")
    say(f"Load Time: {load_time:.2f} s")
    engine.start()
    ttft_ms = await warm_up(engine)
    say(f"First Token Latency: {ttft_ms:.1f} ms")
    profiler = start_profiler(engine, launch)
    sock = bind_socket(launch.host, launch.port)
    port = sock.getsockname()[1]
    app = create_worker_app(engine, launch.served_name, say)
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
        if launch.ready_file is not None:
            write_ready_file(launch.ready_file, info)
        say(f"Serving {launch.served_name} on http://{launch.host}:{port}")
    try:
        await task
    finally:
        await asyncio.to_thread(engine.shutdown)
        if profiler is not None:
            profiler.close()


def start_profiler(engine: Any, launch: EngineLaunch) -> Any:
    """The engine's step profiler when ``trace_prefix`` asks for one (after the warm-up,
    so the trace holds served requests only), else None."""
    if launch.trace_prefix is None:
        return None
    from kunlun.engine.step_profiler import StepProfiler
    from kunlun.telemetry.spec import trace_path

    path = trace_path(launch.trace_prefix, os.getpid())
    profiler = StepProfiler(path, launch.profiling_interval_ms, name=launch.served_name)
    engine.engine.set_profiler(profiler)
    say(f"Advanced profiling: engine steps traced to {path} "
        f"(at most one step per {launch.profiling_interval_ms:g} ms)")  # fmt: skip
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


def import_trusted_modules(launch: EngineLaunch) -> None:
    """Import the engine and server code, and the device's torch extension, before the
    sandbox locks (importing reads many files and maps libraries; what the allow-list must
    permit is then only what serving needs)."""
    import torch  # noqa: F401
    import uvicorn  # noqa: F401

    import kunlun.engine.async_engine  # noqa: F401
    import kunlun.engine.llm_engine  # noqa: F401
    import kunlun.serving.worker_app  # noqa: F401
    from kunlun.engine.device import extension_module, import_extension

    import_extension(launch.torch_module, launch.device)
    extension_module(launch.torch_device_type)  # asks the plugins now, while files may be read


def main(argv: list[str] | None = None) -> int:
    from kunlun.engine.launch import read_launch
    from kunlun.errors import KunlunError
    from kunlun.node import sandbox

    args = parse_args(argv)
    try:
        launch = read_launch(args.launch)
        nice = worker_nice(launch)
    except KunlunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    confinement = None if launch.sandbox is None else sandbox.WorkerSandbox(**launch.sandbox)
    if confinement is not None:
        sandbox.enter(confinement)  # dies with the daemon; rlimits, no_new_privs
    if nice:
        os.nice(nice)  # first, so every thread started later (torch, engine) inherits it
    try:
        if confinement is not None:
            import_trusted_modules(launch)
            sandbox.lock(confinement)  # the seccomp allow-list, before any model file is read
        run_event_loop(serve(launch))
    except KunlunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
