"""Real ``kunlun-platform`` cluster nodes for tests: each its own home and ports, one etcd.

``start_node`` runs a daemon with ``--cluster-etcd``; ``ClusterNodeProc`` adds what the
failure tests need: the node's cluster view, SIGKILL of the whole node (daemon and engine
workers, as when a machine is lost) and SIGSTOP/SIGCONT of the daemon alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from tests import loopback
from tests.daemons import BIN, ONE_THREAD, Daemon, free_port, lost_port

from kunlun.state import ModelRecord
from kunlun.state.store import ROLLOUT_ENDED

LEASE_TTL_S = 10


@dataclass
class ClusterNodeProc(Daemon):
    name: str = ""
    peer_port: int = 0
    args: list[str] = field(default_factory=list)
    key: str | None = None

    def launch(self, *extra: str) -> None:
        """Start the daemon (in a session of its own) and wait for /healthz."""

        def spawn() -> subprocess.Popen[bytes]:
            with self.log_path.open("ab") as log:
                return subprocess.Popen(
                    [str(BIN / "kunlun-platform"), "--port", str(self.port), "--peer-port",
                     str(self.peer_port), "--node-name", self.name, *self.args, *extra],
                    stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True,
                )  # fmt: skip

        self.proc, tries = spawn(), 3
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said, tries = self.log(), tries - 1
                if tries and lost_port(said):
                    self.port = free_port()  # taken by another process since it was chosen
                    self.proc = spawn()
                    continue
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{said}")
            try:
                if loopback.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.name} not up within 120 s:\n{self.log()}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def api(self, path: str, timeout: float = 30) -> Any:
        resp = loopback.get(self.url + path, headers=self.headers(), timeout=timeout)
        assert resp.status_code == 200, (self.name, path, resp.status_code, resp.text)
        return resp.json()

    def post(self, path: str, body: Any = None, timeout: float = 60) -> httpx.Response:
        return loopback.post(self.url + path, json=body, headers=self.headers(), timeout=timeout)

    def kill_node(self) -> None:
        """SIGKILL the daemon and every engine worker of this node (a lost machine)."""
        assert self.proc is not None
        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop_all(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.stop()
        try:
            leftovers = [p for p in psutil.process_iter(["environ"])
                         if (p.info.get("environ") or {}).get("KUNLUN_HOME") == str(self.home)]  # fmt: skip
        except psutil.Error:
            leftovers = []
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def node_args(endpoints: list[str], certs: Path | None, shared: Path) -> list[str]:
    tls = ["--cluster-certs", str(certs)] if certs is not None else ["--insecure-cluster"]
    return ["--cluster-etcd", ",".join(endpoints), "--cluster-lease-ttl", str(LEASE_TTL_S),
            "--cluster-files", str(shared), *tls]  # fmt: skip


def make_node(root: Path, name: str, endpoints: list[str], certs: Path | None) -> ClusterNodeProc:
    home = root / name
    home.mkdir(parents=True, exist_ok=True)
    # the three nodes share this machine's CPU: its utilization says nothing of one node's
    # load, so routing goes by requests in flight alone (then a node's own replica wins ties)
    (home / "scheduler_config.yaml").write_text("min_gpu_utilization_threshold: 1.0\n")
    (home / "device-plugin-config.yaml").write_text(ONE_THREAD)  # the nodes share the cores
    shared = root / "shared-files"  # the directory all nodes share (here: one machine)
    shared.mkdir(exist_ok=True)
    return ClusterNodeProc(home, free_port(), name=name, peer_port=free_port(),
                           args=node_args(endpoints, certs, shared))  # fmt: skip


def wait_for(what: str, check: Callable[[], Any], timeout: float = 180, every: float = 0.25) -> Any:
    """``check()``'s first truthy value; fails naming ``what`` after ``timeout`` s (errors
    from a node being down meanwhile count as not yet)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (AssertionError, httpx.HTTPError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"not within {timeout:g} s: {what} (last: {last!r})")


def serving_replicas(node: ClusterNodeProc, workload_id: str) -> dict[str, list[str]]:
    """Replica id -> the nodes reporting it ready, from ``node``'s ``/api/v1/nodes``."""
    out: dict[str, list[str]] = {}
    for n in node.api("/api/v1/nodes"):
        for r in n["replicas"]:
            if r.get("workload_id") == workload_id and r.get("ready"):
                out.setdefault(r["replica_id"], []).append(n["name"])
    return out


def tiny_record(tiny_model: Path) -> ModelRecord:
    """The tiny model as the catalog alias ``tiny``: a model directory every node reads
    (shared storage), to put in the cluster's store."""
    return ModelRecord(alias="tiny", path=str(tiny_model), source="path", created=time.time())


def chat(node: ClusterNodeProc, text: str = "Say hi.", max_tokens: int = 8) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    return node.post("/v1/chat/completions", body, timeout=120)


def dump(nodes: list[ClusterNodeProc]) -> str:
    return "\n".join(f"--- {n.name} ---\n{n.log()[-3000:]}" for n in nodes)


def rollout_ended(node: ClusterNodeProc, rollout_id: str, timeout: float = 600) -> Any:
    """The rollout, as ``node`` shows it, once it has ended and its losing version stopped."""

    def ended() -> Any:
        row = node.api(f"/api/v1/rollouts/{rollout_id}")
        return row if row["state"] in ROLLOUT_ENDED and row["retired"] else None

    return wait_for("the rollout ended", ended, timeout=timeout)
