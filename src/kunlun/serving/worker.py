"""The engine worker process: one per replica, started by the node agent.

``python -m kunlun.serving.worker --launch FILE`` reads its launch, an
:class:`~kunlun.engine.launch.EngineLaunch` as JSON (model, device, engine settings, its own
settings; nothing else reaches a worker), loads the model into an :class:`LLMEngine`, runs one warm-up generation, then serves the OpenAI API
(:mod:`kunlun.serving.worker_app`) on loopback. Once it accepts connections it writes the
ready file atomically, a :class:`~kunlun.engine.launch.ReadyInfo` as JSON::

    {"pid": 1234, "port": 41234, "load_time_s": 1.23, "warmup_ttft_ms": 45.6,
     "compile_time_s": 0.0, "ranks": [{"rank": 0, "pid": 1234, "device": "cpu:0"}]}

and prints, for the node agent's log capture, ``Compilation Time: 0.00 s`` (the GGUF import
when ``model_dir`` names a ``.gguf`` file, plus casting the weights to ``dtype`` into
``plan_dir`` on a plan's first start, quantizing them when ``quantization`` asks, logged
as ``conversion: ...``; 0 otherwise),
``Load Time: 1.23 s``, ``First Token Latency: 45.6 ms``, then one line per finished request.
With ``tensor_parallel_size`` N > 1 the worker is rank 0 of a group: it starts ranks
1..N-1 (:mod:`kunlun.engine.tp_group`) before anything else, and is ready only once every rank
has loaded. When a rank dies, open streams end with an SSE error event and the worker exits 1,
so the node agent restarts the whole group.
SIGTERM stops accepting connections, lets in-flight requests finish, and exits 0. A bad
launch file (naming the field and value) or a model that cannot load prints the error and
exits 2 (configuration) or 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kunlun.event_loop import run_event_loop

if TYPE_CHECKING:
    from kunlun.engine.launch import EngineLaunch, Rank

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


def worker_nice(launch: EngineLaunch) -> int:
    """The launch's niceness, or ``KUNLUN_WORKER_NICE``, or :data:`WORKER_NICE`; a
    :class:`ConfigError` naming the variable when it is not an integer 0-19."""

    return launch.nice if launch.nice is not None else default_nice()


def default_nice() -> int:
    """``KUNLUN_WORKER_NICE``, or :data:`WORKER_NICE` (also an external engine's server's,
    :mod:`kunlun.node.confine`); a :class:`ConfigError` naming the variable when it is not an
    integer 0-19."""
    from kunlun.errors import ConfigError

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


def start_rank_group(launch: EngineLaunch) -> Any:
    """With ``tensor_parallel_size`` > 1, the other ranks, started (before the sandbox locks:
    it forbids new processes) and joined; None otherwise. The backend is the launch's, which
    the device plugin gave it."""
    if launch.tensor_parallel_size == 1:
        return None
    from kunlun.engine.tp_group import RankGroup
    from kunlun.errors import ConfigError

    if launch.distributed_backend is None:
        raise ConfigError(
            f"tensor_parallel_size={launch.tensor_parallel_size}: the launch names no "
            f"distributed_backend for device {launch.device!r}"
        )
    return RankGroup(launch.tensor_parallel_size, launch.distributed_backend, launch.device)


def build_engine(launch: EngineLaunch, group: Any = None) -> tuple[Any, dict[str, float]]:
    """The :class:`AsyncLLMEngine` for ``launch`` (rank 0 of ``group`` when given), built by
    its own engine thread once started (every torch computation of the worker runs on that
    thread: :mod:`kunlun.engine.async_engine`), and the dict its factory fills with the
    compile (import, conversion) and load times in seconds."""
    from kunlun.engine.async_engine import AsyncLLMEngine

    times: dict[str, float] = {}

    def factory() -> Any:
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

            model_dir, line = prepare_weights(
                model_dir,
                launch.plan_dir / "weights",
                launch.dtype,
                launch.quantization,
                launch.group_size,
            )
            say(line)
        times["compile_time_s"] = time.perf_counter() - started
        started = time.perf_counter()
        import_extension(launch.torch_module, launch.device)
        engine = LLMEngine(launch.engine_config(model_dir), rank_group=group)
        times["load_time_s"] = time.perf_counter() - started
        decode = engine.runner.decode_status
        say(f"Decode path: {decode.path} ({decode.reason})")
        return engine

    step_delay_s = launch.faults.step_delay_ms / 1000.0 if launch.faults else 0.0
    return AsyncLLMEngine(factory, launch.stream_interval, step_delay_s), times


async def warm_up(engine: Any) -> float:
    """Run one short generation and return its time to first token in ms; then a batch of
    a few at once, of different prompt lengths, so that a new replica's first client
    requests do not pay for first-time work (memory first touched, new shapes): measured, a
    fresh replica answered its first requests about a quarter slower than later ones, which
    a canary's latency gates see as a regression."""
    from kunlun.engine.sampling_params import SamplingParams

    started = time.perf_counter()
    ttft = None
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    async for delta in engine.add_request("Hello", params):
        if ttft is None and delta.token_ids:
            ttft = (time.perf_counter() - started) * 1e3
    # cut by tokens, not words: how many tokens a word takes is the tokenizer's business
    budget = max(1, engine.engine.max_model_len // 2 - 8)
    text = engine.engine.tokenizer.encode(" ".join(["warm", "up"] * 80))
    prompts = [text[: min(len(text), budget, n)] for n in (8, 24, 64, 160)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def one(prompt: list[int]) -> None:
        async for _ in engine.add_request(prompt, params):
            pass

    await asyncio.gather(*(one(prompt) for prompt in prompts))
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


async def serve(launch: EngineLaunch, group: Any = None) -> None:
    import uvicorn

    from kunlun.engine.launch import ReadyInfo
    from kunlun.serving.handoff_worker import HandoffServer
    from kunlun.serving.worker_app import KeyGuard, create_worker_app

    engine, times = build_engine(launch, group)
    await engine.ready()
    compile_time, load_time = times["compile_time_s"], times["load_time_s"]
    say(f"Compilation Time: {compile_time:.2f} s")
    say(f"Load Time: {load_time:.2f} s")
    ttft_ms = await warm_up(engine)
    say(f"First Token Latency: {ttft_ms:.1f} ms")
    profiler = start_profiler(engine, launch)
    sock = bind_socket(launch.host, launch.port)
    port = sock.getsockname()[1]
    app: Any = create_worker_app(engine, launch.served_name, say, launch.faults,
                                 task=launch.task, pooling=launch.pooling)  # fmt: skip
    if launch.access_key is not None:  # its node's daemon only (kunlun.headers.WORKER_KEY)
        app = KeyGuard(app, launch.access_key)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=30, proxy_headers=False)  # fmt: skip
    server = uvicorn.Server(config)
    handoff = HandoffServer(app, say)  # direct streams: the gateway hands requests over
    handoff.start()
    lost = watch_rank_group(group, engine, server)
    # uvicorn re-raises the SIGTERM it handled once drained: make that a no-op, so the
    # worker shuts the engine down and exits 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        if launch.ready_file is not None:
            ReadyInfo(pid=os.getpid(), port=port, load_time_s=round(load_time, 3),
                      warmup_ttft_ms=round(ttft_ms, 1), compile_time_s=round(compile_time, 3),
                      ranks=ranks(group, launch.device),
                      handoff=handoff.address).write(launch.ready_file)  # fmt: skip
        say(f"Serving {launch.served_name} on http://{launch.host}:{port}")
    try:
        await task
    finally:
        await handoff.close()
        await asyncio.to_thread(engine.shutdown)
        if profiler is not None:
            profiler.close()
    if lost:
        from kunlun.errors import EngineError

        raise EngineError(lost[0])


def ranks(group: Any, device: str) -> tuple[Rank, ...]:
    """Each rank of the replica: its number, process id and device (for ``workload describe``)."""
    from kunlun.engine.launch import Rank
    from kunlun.engine.tp_group import rank_device

    pids = [os.getpid(), *([] if group is None else group.pids)]
    return tuple(Rank(rank=rank, pid=pid, device=rank_device(device, rank))
                 for rank, pid in enumerate(pids))  # fmt: skip


def watch_rank_group(group: Any, engine: Any, server: Any) -> list[str]:
    """When a rank of ``group`` dies: fail every open stream (each gets an SSE error event),
    stop serving and let :func:`serve` exit with the reason (the node agent restarts the
    replica, all its ranks together). Returns the list the reason lands in."""
    lost: list[str] = []
    if group is None:
        return lost
    loop = asyncio.get_running_loop()

    def on_lost(reason: str) -> None:  # the group's watcher thread
        from kunlun.errors import EngineError

        say(f"error: {reason}")
        lost.append(reason)
        engine.fail_all(EngineError(reason, hint="the replica restarts; retry the request"))
        loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    group.on_lost = on_lost
    return lost


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
    from kunlun import sandbox
    from kunlun.engine.launch import read_launch
    from kunlun.errors import KunlunError

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
        group = start_rank_group(launch)  # new processes: before the sandbox forbids them
        if confinement is not None:
            import_trusted_modules(launch)
            sandbox.lock(confinement)  # the seccomp allow-list, before any model file is read
        run_event_loop(serve(launch, group))
    except KunlunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
