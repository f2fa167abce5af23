"""The node agent's engine supervisor: one worker process per replica, kept alive.

Each replica is one process started from its engine adapter's command
(:class:`~kunlun.engines.adapter.EngineCommand`) with its device's visibility environment,
its output appended to ``KUNLUN_HOME/logs/<workload>.log``. The embedded engine's is a
``python -m kunlun.serving.worker --launch FILE`` process, ``FILE`` the replica's
:class:`~kunlun.engine.launch.EngineLaunch` with its ready file and sandbox, written to
``KUNLUN_HOME/run/workers/<replica>.launch.json`` before each start; an external engine's
server is described in :mod:`kunlun.node.external`. The
supervisor loop notices a worker's ready file (the worker writes it after loading and a
warm-up generation), marks the replica ready in the :class:`ReplicaSet`, and restarts a worker
that dies, with exponential backoff (1 s doubling to 60 s; reset after 60 s of health). It
probes every ready worker's liveness and forward progress (:mod:`kunlun.node.liveness`): one
that misses its deadline is taken out of routing (its ``Replica.fault`` says why), killed
with SIGKILL and restarted like a crashed one. Every start, readiness, crash, kill and restart
is reported through ``on_event`` (and a kill also in the workload's log). Worker pid files under
``KUNLUN_HOME/run/workers`` let a restarted daemon find and reap workers that a crashed daemon
left behind (a worker dies with its daemon, so these are rare: a worker that was stopped
when its daemon died, or one started before this rule).

Each worker is confined by the :mod:`kunlun.sandbox` its :class:`WorkerSandbox` says
(the launch's ``sandbox`` field): a clean environment (:meth:`NodeAgent.worker_env`), its own
directory, rlimits, seccomp. The supervisor enforces its host memory cap: a worker over it is
killed and its workload fails (``worker exceeded its memory cap of N MiB``); a worker killed
by the seccomp filter (SIGSYS) fails its workload with the forbidden call. Workers are
spawned on the daemon's main (event loop) thread: a worker's death signal fires when the
thread that started it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil

from kunlun.engine.launch import EngineLaunch, ReadyInfo
from kunlun.engines.adapter import EngineCommand
from kunlun.errors import ConfigError, KunlunError
from kunlun.node import external
from kunlun.node.liveness import EventSink, Liveness, LivenessConfig, probe
from kunlun.node.worker_state import (
    HEALTHY_RESET_S,
    MAX_BACKOFF_S,
    MAX_LOAD_FAILURES,
    Worker,
    last_error,
    thread_count,
)
from kunlun.sandbox import (
    SandboxPolicy,
    over_memory_cap,
    seccomp_reason,
    worker_environment,
)
from kunlun.serving.replica import Replica, ReplicaSet


class NodeAgent:
    """Starts, watches, restarts and stops engine workers."""

    def __init__(
        self,
        home: Path,
        replicas: ReplicaSet,
        on_event: EventSink,
        sandbox: SandboxPolicy | None = None,
        liveness: LivenessConfig | None = None,
    ) -> None:
        self.home = home
        self.sandbox = sandbox or SandboxPolicy(home)
        self.replicas = replicas
        self.on_event = on_event
        self.liveness = liveness or LivenessConfig()
        self.workers: dict[str, Worker] = {}
        self.run_dir = home / "run" / "workers"
        self.log_dir = home / "logs"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def log_path(self, workload_id: str) -> Path:
        return self.log_dir / f"{workload_id}.log"

    def note(self, workload_id: str, line: str) -> None:
        """Append one line of the platform's own (e.g. ``plan_cache: hit``) to the workload's log."""
        with self.log_path(workload_id).open("a", encoding="utf-8") as log:
            log.write(line.rstrip("\n") + "\n")

    # ---- starting and stopping ----
    def launch(
        self, replica: Replica, command: EngineCommand, env: dict[str, str],
        memory_cap_mb: int | None = None, launch: EngineLaunch | None = None,
    ) -> Worker:  # fmt: skip
        """Register a replica; the supervisor loop starts its process at once from
        ``command``, its engine adapter's (:func:`kunlun.engines.registry.engine_command`).
        ``env`` is its whole environment (:meth:`worker_env`); ``memory_cap_mb`` its host
        memory cap.

        The embedded worker's ``launch`` gets its ready file and sandbox and is written to
        :meth:`launch_file` (which the command reads) before each start; the worker confines
        itself by it and writes its ready file. An external server is ready once
        ``ready_path`` answers 200 on its port; it is started confined
        (:mod:`kunlun.node.confine`: dies with the daemon, rlimits, no_new_privs, niceness)
        without the worker's seccomp allow-list; its clean environment, own directory and
        memory cap are the agent's, as for a worker."""
        ready_file = self.run_dir / f"{replica.replica_id}.ready.json"
        sandbox = self.sandbox.for_worker(replica.replica_id, memory_cap_mb)
        if launch is None:
            sandbox = dataclasses.replace(sandbox, seccomp=False)  # see kunlun.node.confine
        replica.stats_path = command.stats_path or replica.stats_path
        worker = Worker(replica, command, launch, env, command.log_file, ready_file, sandbox)
        self.workers[replica.replica_id] = worker
        self.replicas.upsert(replica)
        return worker

    def stop_workload(self, workload_id: str, timeout_s: float = 15.0) -> None:
        """Stop every worker of a workload: SIGTERM, then SIGKILL after ``timeout_s``."""
        targets = [w for w in self.workers.values() if w.replica.workload_id == workload_id]
        self._stop(targets, timeout_s)

    def stop_replica(self, replica_id: str, timeout_s: float = 15.0) -> None:
        """Stop one worker (a cluster node handing a replica to another node)."""
        self._stop([w for w in self.workers.values() if w.replica.replica_id == replica_id],
                   timeout_s)  # fmt: skip

    def stop_all(self, timeout_s: float = 15.0) -> None:
        self._stop(list(self.workers.values()), timeout_s)

    def _stop(self, workers: list[Worker], timeout_s: float) -> None:
        for w in workers:
            w.stopping = True
            w.replica.ready = False
            if w.proc and w.proc.poll() is None:
                w.proc.send_signal(w.command.stop_signal)
        deadline = time.monotonic() + timeout_s
        for w in workers:
            if w.proc is not None:
                try:
                    w.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()
            self._forget(w)

    def _forget(self, w: Worker) -> None:
        self.workers.pop(w.replica.replica_id, None)
        self.replicas.remove(w.replica.replica_id)
        for path in (self._pid_file(w), w.ready_file, self.launch_file(w.replica.replica_id)):
            path.unlink(missing_ok=True)
        if w.sandbox.workdir is not None:
            self._remove_workdir(Path(w.sandbox.workdir), w.replica.workload_id)

    def _remove_workdir(self, path: Path, workload_id: str) -> None:
        """Remove a worker's own directory (its temporary files) once it has exited."""
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.on_event(workload_id, "sandbox", f"cannot remove {path}: {exc}")

    # ---- supervision ----
    async def supervise(self, interval_s: float = 0.1) -> None:
        """Run forever: start due workers, notice readiness, probe the ready ones, restart
        crashed and unresponsive ones."""
        async with httpx.AsyncClient(trust_env=False) as client:
            try:
                while True:
                    for w in list(self.workers.values()):
                        try:
                            self._tick(w)
                            self._maybe_check_ready(w, client)
                            self._maybe_probe(w, client)
                        except Exception as exc:  # noqa: BLE001 - one bad worker must not stop the loop
                            self.on_event(w.replica.workload_id, "error", f"supervisor: {exc!r}")
                    await asyncio.sleep(interval_s)
            finally:
                for w in self.workers.values():
                    for task in (w.probing, w.checking):
                        if task is not None:
                            task.cancel()

    def _maybe_probe(self, w: Worker, client: httpx.AsyncClient) -> None:
        if w.liveness is None or w.proc is None or w.stopping or not w.replica.ready:
            return
        now = time.monotonic()
        if w.probing is not None or now < w.next_probe:
            return
        w.next_probe = now + self.liveness.probe_interval_s
        w.probing = asyncio.create_task(self._probe(w, w.proc, client))

    async def _probe(
        self, w: Worker, proc: subprocess.Popen[bytes], client: httpx.AsyncClient
    ) -> None:
        """Probe ``w`` once and act on the verdict (unless its process changed meanwhile)."""
        try:
            try:
                r = w.replica
                stats = await probe(client, r, self.liveness.probe_timeout_s)
            except (httpx.HTTPError, ValueError) as exc:
                stats, why = None, f"{type(exc).__name__}: {exc}".rstrip(": ")
            if w.proc is not proc or w.liveness is None or w.stopping:
                return
            now = time.monotonic()
            if stats is not None:
                reason = w.liveness.answered(stats, now)
            else:
                reason = w.liveness.missed(why, now)
            if reason is not None:
                self._kill_unresponsive(w, reason)
        finally:
            w.probing = None

    def _kill_unresponsive(self, w: Worker, reason: str) -> None:
        """Out of routing, SIGKILL; the next tick sees it die and restarts it."""
        if w.proc is None:
            return
        r = w.replica
        r.ready, r.fault, w.killed_for, w.liveness = False, reason, reason, None
        self.replicas.upsert(r)
        w.ready_file.unlink(missing_ok=True)  # its readiness is over
        message = f"replica {r.replica_id} (pid {w.proc.pid}) is unresponsive: {reason}; killing it"
        with contextlib.suppress(OSError):
            self.note(r.workload_id, f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {message}")
        self.on_event(r.workload_id, "unresponsive", message)
        w.proc.kill()

    def _tick(self, w: Worker) -> None:
        if w.stopping:
            return
        now = time.monotonic()
        if w.proc is None:
            if w.next_start is not None and now >= w.next_start:
                self._spawn(w)
            return
        code = w.proc.poll()
        if code is not None:
            self._crashed(w, code)
            return
        over = over_memory_cap(w.proc.pid, w.sandbox.memory_cap_mb)
        if over is not None:
            w.proc.kill()
            w.proc.wait()
            self._give_up(w, f"worker exceeded its memory cap of {w.sandbox.memory_cap_mb} MiB "
                             f"(private resident {over} MiB); it was stopped")  # fmt: skip
            return
        if (
            not w.asks_ready
            and not w.replica.ready
            and w.killed_for is None
            and (w.ready_file.exists())
        ):
            self._became_ready(w)
        elif w.ready_at is not None and now - w.ready_at > HEALTHY_RESET_S:
            w.backoff_s = 1.0

    def _maybe_check_ready(self, w: Worker, client: httpx.AsyncClient) -> None:
        """An external engine still loading: ask its ready path (one check in flight)."""
        if (not w.asks_ready or w.proc is None or w.stopping or w.replica.ready
                or w.checking is not None or w.killed_for is not None):  # fmt: skip
            return
        w.checking = asyncio.create_task(self._check_ready(w, w.proc, client))

    async def _check_ready(
        self, w: Worker, proc: subprocess.Popen[bytes], client: httpx.AsyncClient
    ) -> None:
        try:
            info = await external.ready_info(client, w.command, w.started_at)
            if info is not None and w.proc is proc and not w.stopping:
                self._became_ready(w, info)
        finally:
            w.checking = None

    def _command(self, w: Worker) -> list[str]:
        """The argv to start: the embedded worker's, once its launch file is written with
        this start's ready file and sandbox (the worker confines itself by it); an external
        engine's server's, confined (:func:`kunlun.node.external.start_argv`)."""
        keyed = w.launch is not None or w.command.key_env is not None
        w.replica.worker_key = secrets.token_urlsafe(32) if keyed else None  # this start's
        if w.launch is None:
            return external.start_argv(w.command, w.sandbox)
        w.ready_file.unlink(missing_ok=True)
        launch = w.launch.model_copy(update={
            "ready_file": w.ready_file, "sandbox": json.loads(w.sandbox.to_json()),
            "access_key": w.replica.worker_key,
        })  # fmt: skip
        launch.write(self.launch_file(w.replica.replica_id))
        return list(w.command.argv)

    def _spawn(self, w: Worker) -> None:
        try:
            cmd = self._command(w)
        except KunlunError as exc:  # a bad KUNLUN_WORKER_NICE: every start would fail alike
            self._give_up(w, str(exc))
            return
        with w.log_path.open("ab") as log:
            log.write(
                f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} replica {w.replica.replica_id} starting on {w.replica.device}\n".encode()
            )
            log.flush()
            w.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=w.start_env,
                cwd=w.sandbox.workdir,
                start_new_session=True,
            )
        w.started_at, w.next_start, w.ready_at = time.monotonic(), None, None
        w.killed_for, w.liveness = None, None
        w.replica.pid = w.proc.pid
        problem = self.sandbox.join_cgroup(
            w.replica.workload_id, w.proc.pid, w.sandbox.memory_cap_mb, thread_count(w.env)
        )
        if problem is not None:  # said once: later workers skip cgroups
            print(problem, flush=True)
            self.on_event(w.replica.workload_id, "sandbox", problem)
        create_time = psutil.Process(w.proc.pid).create_time()
        self._pid_file(w).write_text(json.dumps({"pid": w.proc.pid, "create_time": create_time}))
        self.on_event(
            w.replica.workload_id,
            "started",
            f"replica {w.replica.replica_id} started (pid {w.proc.pid}) on {w.replica.device}",
        )

    def _became_ready(self, w: Worker, info: ReadyInfo | None = None) -> None:
        """The worker's ready file appeared (or an external engine answered: ``info``)."""
        try:
            info = info or ReadyInfo.read(w.ready_file)
        except ConfigError as exc:  # written atomically by our own worker: a defect
            assert w.proc is not None
            w.proc.kill()
            w.proc.wait()
            self._give_up(w, f"its ready file: {exc}")
            return
        if info is None:
            return
        port = info.port
        w.info = info
        w.replica.base_url = f"http://127.0.0.1:{port}"
        w.replica.handoff = info.handoff
        w.replica.ready, w.replica.fault = True, None
        w.ready_at = time.monotonic()
        w.liveness, w.next_probe = Liveness(self.liveness, w.ready_at), w.ready_at
        w.load_failures = 0
        self.replicas.upsert(w.replica)
        self.on_event(
            w.replica.workload_id,
            "ready",
            f"replica {w.replica.replica_id} ready on port {port} (load {info.load_time_s} s, first token {info.warmup_ttft_ms} ms)",
        )

    def _crashed(self, w: Worker, code: int) -> None:
        was_ready = w.replica.ready or w.killed_for is not None
        w.replica.ready = False
        w.proc, w.liveness = None, None
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        if code == -signal.SIGSYS and w.sandbox.seccomp and w.sandbox.enabled:
            self._give_up(w, seccomp_reason(w.replica.pid or 0))  # the same call would recur
            return
        if w.killed_for is not None:
            how = f"killed by the supervisor: {w.killed_for}"
        if not was_ready:
            w.load_failures += 1
            reported = last_error(w.log_path)
            if reported is not None or w.load_failures >= MAX_LOAD_FAILURES:
                # the worker said why it cannot load (or keeps dying): restarting will not help
                self._give_up(w, reported or f"died {w.load_failures} times while loading ({how})")
                return
        w.restarts += 1
        delay = w.backoff_s
        w.backoff_s = min(MAX_BACKOFF_S, w.backoff_s * 2)
        w.next_start = time.monotonic() + delay
        phase = "while serving" if was_ready else "while loading"
        self.on_event(
            w.replica.workload_id,
            "crashed",
            f"replica {w.replica.replica_id} died ({how}) {phase}; restart #{w.restarts} in {delay:g} s",
        )

    def _give_up(self, w: Worker, why: str) -> None:
        """Stop supervising ``w`` (its process has exited) and fail its workload with ``why``."""
        w.stopping = True
        w.proc = None
        self._forget(w)
        self.on_event(
            w.replica.workload_id, "failed", f"replica {w.replica.replica_id} cannot run: {why}"
        )

    def _pid_file(self, w: Worker) -> Path:
        return self.run_dir / f"{w.replica.replica_id}.pid"

    def launch_file(self, replica_id: str) -> Path:
        """Where the embedded worker of ``replica_id`` reads its launch (written before each
        start; its adapter's command names it)."""
        return self.run_dir / f"{replica_id}.launch.json"

    # ---- leftovers of a crashed daemon ----
    def reap_leftovers(self) -> list[int]:
        """Kill workers recorded in pid files by an earlier daemon that are still alive."""
        reaped = []
        for pid_file in self.run_dir.glob("*.pid"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                data = json.loads(pid_file.read_text())
                pid = int(data["pid"])
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(pid)
                    if abs(proc.create_time() - float(data["create_time"])) < 1.0:
                        proc.kill()
                        reaped.append(pid)  # SIGKILL: gone, or a zombie its new parent reaps
                        with contextlib.suppress(psutil.TimeoutExpired):
                            proc.wait(5)
            pid_file.unlink(missing_ok=True)
        for leftover in [*self.run_dir.glob("*.ready.json"), *self.run_dir.glob("*.launch.json")]:
            leftover.unlink(missing_ok=True)
        for workdir in (p for p in self.run_dir.iterdir() if p.is_dir()):
            self._remove_workdir(workdir, workdir.name.rsplit("-r", 1)[0])
        return reaped

    def worker_env(
        self, replica_id: str, device_env: dict[str, str], runtime_env: tuple[str, ...],
        num_threads: int,
    ) -> dict[str, str]:  # fmt: skip
        """The environment of a worker: with the sandbox on, only what it needs (see
        :func:`~kunlun.sandbox.worker_environment`); off, the daemon's own. Both with
        ``device_env`` (the plan's visibility and engine variables) and the thread count."""
        if not self.sandbox.enabled:
            env = dict(os.environ, OMP_NUM_THREADS=str(num_threads), PYTHONUNBUFFERED="1")
            env.update(device_env)
            return env
        return worker_environment(
            home=self.home,
            workdir=self.sandbox.workdir(replica_id),
            device_env=device_env,
            runtime_env=runtime_env,
            num_threads=num_threads,
        )
