"""A real etcd cluster for tests: members on free ports of 127.0.0.1, optionally with TLS.

    cluster = EtcdCluster(tmp_path, members=3, certs=certs_dir)
    cluster.start()                  # waits until every member is healthy
    cluster.kill(0); cluster.restart(0)
    cluster.stop()                   # also run at interpreter exit, whatever happened

``certs`` is a directory made by :func:`kunlun.state.certs.make_certs` with the names
``etcd-0`` .. ``etcd-N``: clients and peers then need a certificate from its CA. Each
member logs to ``root/etcd-N.log``; a member that does not come up fails with that log's tail.
"""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx

from kunlun.state.certs import MemberTLS

ETCD = shutil.which("etcd")
START_TIMEOUT_S = 30.0
_LOG_TAIL = 30


class EtcdCluster:
    def __init__(self, root: Path, members: int = 3, certs: Path | None = None) -> None:
        self.root = root
        self.num_members = members
        self.certs = certs
        self.scheme = "https" if certs else "http"
        self.endpoints: list[str] = []
        self._peer_urls: list[str] = []
        self._token = f"kunlun-test-{uuid.uuid4().hex[:8]}"
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * members
        atexit.register(self.stop)

    def start(self) -> None:
        """Start every member and wait until all are healthy (a port taken meanwhile by
        another process: a second try on other ports)."""
        for attempt in range(3):
            ports = _free_ports(2 * self.num_members)
            self.endpoints = [f"{self.scheme}://127.0.0.1:{p}" for p in ports[::2]]
            self._peer_urls = [f"{self.scheme}://127.0.0.1:{p}" for p in ports[1::2]]
            for i in range(self.num_members):
                self._log(i).unlink(missing_ok=True)
                self._launch(i, "new")
            try:
                for i in range(self.num_members):
                    self._wait_healthy(i)
                return
            except RuntimeError:
                self.stop()
                if attempt == 2 or not self._port_clash():
                    raise
                for i in range(self.num_members):
                    shutil.rmtree(self._data_dir(i), ignore_errors=True)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (no clean shutdown)."""
        proc = self._procs[i]
        if proc is not None:
            proc.kill()
            proc.wait()
            self._procs[i] = None

    def restart(self, i: int) -> None:
        """Start member ``i`` again on its data directory and wait until it is healthy."""
        self.kill(i)
        self._launch(i, "existing")
        self._wait_healthy(i)

    def stop(self) -> None:
        for i in range(self.num_members):
            self.kill(i)

    def tls(self, name: str) -> MemberTLS:
        """The certificate pair ``name`` of the cluster's certificate directory."""
        assert self.certs is not None
        return MemberTLS.from_dir(self.certs, name)

    def _data_dir(self, i: int) -> Path:
        return self.root / f"etcd-{i}.data"

    def _log(self, i: int) -> Path:
        return self.root / f"etcd-{i}.log"

    def _launch(self, i: int, state: str) -> None:
        if ETCD is None:
            raise RuntimeError("etcd is not installed")
        name = f"etcd-{i}"
        initial = ",".join(f"etcd-{j}={url}" for j, url in enumerate(self._peer_urls))
        args = [
            ETCD,
            f"--name={name}",
            f"--data-dir={self._data_dir(i)}",
            f"--listen-client-urls={self.endpoints[i]}",
            f"--advertise-client-urls={self.endpoints[i]}",
            f"--listen-peer-urls={self._peer_urls[i]}",
            f"--initial-advertise-peer-urls={self._peer_urls[i]}",
            f"--initial-cluster={initial}",
            f"--initial-cluster-state={state}",
            f"--initial-cluster-token={self._token}",
            "--heartbeat-interval=100",
            "--election-timeout=1000",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self.certs is not None:
            ca, cert, key = (self.certs / f for f in ("ca.crt", f"{name}.crt", f"{name}.key"))
            args += [
                f"--cert-file={cert}",
                f"--key-file={key}",
                f"--trusted-ca-file={ca}",
                "--client-cert-auth",
                f"--peer-cert-file={cert}",
                f"--peer-key-file={key}",
                f"--peer-trusted-ca-file={ca}",
                "--peer-client-cert-auth",
            ]
        self.root.mkdir(parents=True, exist_ok=True)
        with self._log(i).open("ab") as log:
            self._procs[i] = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def _wait_healthy(self, i: int) -> None:
        verify = self.tls("etcd-0").client_context() if self.certs else True
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(verify=verify, timeout=1.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                proc = self._procs[i]
                if proc is None or proc.poll() is not None:
                    break
                try:
                    if client.get(f"{self.endpoints[i]}/health").json().get("health") == "true":
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.1)
        tail = self._log(i).read_text(errors="replace").splitlines()[-_LOG_TAIL:]
        raise RuntimeError(
            f"etcd member {i} ({self.endpoints[i]}) is not healthy after "
            f"{START_TIMEOUT_S:g} s; the end of {self._log(i)}:\n" + "\n".join(tail)
        )

    def _port_clash(self) -> bool:
        return any(
            "address already in use" in self._log(i).read_text(errors="replace")
            for i in range(self.num_members)
            if self._log(i).exists()
        )


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (all held open until all are chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()
