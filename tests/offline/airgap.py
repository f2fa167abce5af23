"""The air-gapped half of the offline chain, run inside ``unshare -n`` (no network but a
loopback brought up here) by ``test_airgap.py`` with the system's Python and nothing else.

    python3 airgap.py WORK PORT install|package|serve

``WORK`` holds ``kunlun-offline.tar``, ``model.kunlunpkg`` and ``keys/kunlun-signing.pub``.
``install`` installs the bundle with the installer taken out of the bundle into
``WORK/prefix`` (and trusts the key in ``WORK/home``); ``package`` installs the model package
with the installed ``kunlun-installer``, as a later package is; ``serve`` (after them)
starts the installed platform with ``--require-signed``, serves the packaged model and asks
it for a chat answer; a plain model directory is refused. Each prints one JSON object of
findings.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

work, port, stage = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
found: dict[str, Any] = {}


def reachable(host: str, port: int) -> str:
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "connected"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def call(method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


found["internet"] = reachable("1.1.1.1", 443)
found["interfaces"] = sorted(name for _, name in socket.if_nameindex())
prefix, home = work / "prefix", work / "home"


def install() -> None:
    with tarfile.open(work / "kunlun-offline.tar") as tar:  # the installer comes out of the bundle
        tar.extract("kunlun-installer.pyz", work, filter="data")
    key = work / "keys" / "kunlun-signing.pub"
    installed = subprocess.run(
        [sys.executable, "-S", str(work / "kunlun-installer.pyz"), "install", "--bundle",
         str(work / "kunlun-offline.tar"), "--public-key", str(key), "--prefix", str(prefix),
         "--home", str(home)],
        capture_output=True, text=True, env={**os.environ, "PIP_NO_CACHE_DIR": "1"},
    )  # fmt: skip
    found["install"] = {"rc": installed.returncode, "out": installed.stdout, "err": installed.stderr,
                        "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
    if installed.returncode != 0:
        return
    found["unit"] = (prefix / "share" / "systemd" / "kunlun-platform.service").read_text()


def package() -> None:
    installed = subprocess.run(
        [str(prefix / "bin" / "kunlun-installer"), "install", "--home", str(home),
         "--package", str(work / "model.kunlunpkg"),
         "--public-key", str(work / "keys" / "kunlun-signing.pub")],
        capture_output=True, text=True,
    )  # fmt: skip
    found["package"] = {"rc": installed.returncode, "out": installed.stdout,
                        "err": installed.stderr}  # fmt: skip
    listed = subprocess.run([str(prefix / "bin" / "kunlun-installer"), "list", "--home", str(home)],
                            capture_output=True, text=True)  # fmt: skip
    found["list"] = {"rc": listed.returncode, "out": listed.stdout, "err": listed.stderr}


def serve() -> None:
    env = {**os.environ, "KUNLUN_HOME": str(home)}
    env.pop("KUNLUN_ENDPOINT", None)
    log = (work / "daemon.log").open("wb")
    daemon = subprocess.Popen(
        [str(prefix / "bin" / "kunlun-platform"), "--port", str(port), "--require-signed"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while reachable("127.0.0.1", port) != "connected":
            assert daemon.poll() is None and time.monotonic() < deadline, "daemon did not start"
            time.sleep(0.3)
        cli = [str(prefix / "bin" / "kunlun-cli"), "workload", "submit", "--max-num-seqs", "4",
               "--json"]  # fmt: skip
        submitted = subprocess.run([*cli, "--model", "smollm2"], capture_output=True, text=True,
                                   env=env)  # fmt: skip
        found["submit"] = {"rc": submitted.returncode, "err": submitted.stderr}
        job = json.loads(submitted.stdout)["workload_id"]
        plain = work / "plain-model"  # the same files (hard links), not installed from a package
        shutil.copytree(home / "packages" / "smollm2", plain, dirs_exist_ok=True,
                        copy_function=os.link)  # fmt: skip
        model_dir = next(plain.glob("*/model"))
        refused = subprocess.run([*cli, "--model", str(model_dir), "--name", "plain"],
                                 capture_output=True, text=True, env=env)  # fmt: skip
        found["plain"] = {"rc": refused.returncode, "err": refused.stderr}
        deadline = time.monotonic() + 300
        while call("GET", "/readyz")[0] != 200:
            assert daemon.poll() is None and time.monotonic() < deadline, "no replica ready"
            time.sleep(0.3)
        status, answer = call("POST", "/v1/chat/completions", {
            "model": "smollm2", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})  # fmt: skip
        found["chat"] = {"status": status, "answer": answer,
                         "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
        logs = subprocess.run([str(prefix / "bin" / "kunlun-cli"), "workload", "logs", job],
                              capture_output=True, text=True, env=env)  # fmt: skip
        found["logs"] = logs.stdout
        found["metrics"] = [
            line for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30)
            .read().decode().splitlines() if line.startswith("kunlun_integrity_ok")
        ]  # fmt: skip
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(90)
        except subprocess.TimeoutExpired:
            daemon.kill()
        found["daemon_log"] = (work / "daemon.log").read_text(errors="replace")[-4000:]
        audit = home / "logs" / "audit.jsonl"
        found["audit"] = (
            [json.loads(x) for x in audit.read_text().splitlines()] if audit.exists() else []
        )
        print(json.dumps(found))


started = time.monotonic()
if stage in ("install", "package"):
    install() if stage == "install" else package()
    print(json.dumps(found))
else:
    serve()  # prints its findings, also when it fails
