"""Fixtures for serving tests: real engine workers and a real gateway on loopback.

``worker`` is ONE engine worker subprocess on the demo model (fp32, cpu, small KV cache,
``max_num_seqs`` 8), shared by the whole session. ``gateway`` is a uvicorn server in a
thread serving a FastAPI app that mounts the gateway (:func:`mount_gateway`) over a :class:`ReplicaSet`
holding that worker (ready, as replica ``r1`` of model ``smollm2``). ``start_worker``
starts extra workers for tests that kill one. Clients are the real ``openai`` SDK.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests import loopback

from kunlun.engine.launch import ReadyInfo, worker_command
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.serving.worker import bind_socket, write_launch

MODEL = "smollm2"
MAX_MODEL_LEN = 512


@dataclass
class WorkerProcess:
    """A running worker: its process, base URL and log file."""

    process: subprocess.Popen[bytes]
    base_url: str
    ready: dict[str, object]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stats(self) -> dict[str, int]:
        return loopback.get(f"{self.base_url}/stats", timeout=10).json()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def launch_worker(
    folder: Path,
    model_dir: Path,
    served_name: str = MODEL,
    timeout_s: float = 240,
    **settings: object,
) -> WorkerProcess:
    """A worker serving ``model_dir`` (the demo model) as ``served_name``; ``settings`` are
    other launch fields."""
    folder.mkdir(parents=True, exist_ok=True)
    ready_file, log_path = folder / "ready.json", folder / "worker.log"
    launch = write_launch(
        folder / "launch.json", model_dir, served_name, ready_file=ready_file, max_num_seqs=8,
        kv_cache_memory_bytes=64 << 20, max_model_len=MAX_MODEL_LEN, num_threads=1, **settings,
    )  # fmt: skip
    command = worker_command(launch)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while (ready := ReadyInfo.read(ready_file)) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"worker did not become ready:\n{log_path.read_text()}")
        time.sleep(0.1)
    return WorkerProcess(process, f"http://127.0.0.1:{ready.port}",
                         ready.model_dump(mode="json", exclude_none=True), log_path)  # fmt: skip


@pytest.fixture(scope="session")
def worker(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    process = launch_worker(tmp_path_factory.mktemp("worker"), demo_model_dir)
    yield process
    process.stop()


@pytest.fixture
def start_worker(demo_model_dir: Path, tmp_path: Path) -> Iterator[Callable[[str], WorkerProcess]]:
    """Start an extra worker serving the demo model under another name."""
    started: list[WorkerProcess] = []

    def start(served_name: str) -> WorkerProcess:
        started.append(launch_worker(tmp_path / served_name, demo_model_dir, served_name))
        return started[-1]

    yield start
    for process in started:
        process.stop()


@dataclass
class GatewayServer:
    """The gateway app on loopback, with its replica set and state open to tests."""

    replicas: ReplicaSet
    state: object
    base_url: str
    server: object = field(repr=False)


def serve_in_thread(app: object) -> tuple[object, str, threading.Thread]:
    """Run ``app`` with uvicorn on a free loopback port in a daemon thread."""
    import uvicorn

    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(app, log_level="warning", access_log=False)  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the gateway server did not start")
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}", thread


@pytest.fixture(scope="session")
def gateway(worker: WorkerProcess) -> Iterator[GatewayServer]:
    with gateway_over(worker.base_url) as server:
        yield server


@contextlib.contextmanager
def gateway_over(worker_url: str, handoff: str | None = None) -> Iterator[GatewayServer]:
    """A gateway serving ``MODEL`` through one ready replica ``r1`` at ``worker_url``, keeping
    Responses API answers in a state store of its own (as the daemon's gateway does);
    ``handoff``: the replica's direct-stream socket, the app wrapped as the daemon's is."""
    import tempfile

    from fastapi import FastAPI

    from kunlun.serving.gateway import mount_gateway
    from kunlun.serving.gateway_state import GatewayState
    from kunlun.serving.handoff import ClientSocketScope
    from kunlun.serving.response_state import ResponseState
    from kunlun.state.sqlite import SQLiteStore

    replicas, state = ReplicaSet(), GatewayState()
    folder = tempfile.TemporaryDirectory(prefix="kunlun-gateway-")
    state.responses = ResponseState(SQLiteStore(Path(folder.name) / "state.db"))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        yield
        await state.close()

    replicas.upsert(Replica("r1", "w1", MODEL, "cpu:0", worker_url, ready=True, handoff=handoff))
    app = FastAPI(lifespan=lifespan)
    mount_gateway(app, replicas, state)
    server, base_url, thread = serve_in_thread(ClientSocketScope(app) if handoff else app)
    try:
        yield GatewayServer(replicas, state, base_url, server)
    finally:
        server.should_exit = True  # type: ignore[attr-defined]
        thread.join(10)
        folder.cleanup()
