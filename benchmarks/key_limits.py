"""Per-key rate limits under a client that never waits; prints one JSON object.

Starts a real ``kunlun-platform`` (no model: ``GET /v1/models`` is the request) in a
temporary ``KUNLUN_HOME`` with one key created ``--rpm RPM``, then sends requests with that
key back to back for ``--seconds`` and counts the 200s and the 429s (and the ``Retry-After``
values seen). A token bucket of one minute's worth admits ``RPM`` at once and then
``RPM / 60`` a second, so ``expected_admitted`` is ``RPM + RPM * seconds / 60``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rpm", type=int, default=60, help="the key's requests per minute")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to send")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, KUNLUN_HOME=home)
        made = subprocess.run(
            [str(BIN / "kunlun-cli"), "apikey", "create", "burst", "--rpm", str(args.rpm),
             "--json"], env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        key = json.loads(made.stdout)["key"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        daemon = subprocess.Popen([str(BIN / "kunlun-platform"), "--port", str(port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    if httpx.get(url + "/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            client = httpx.Client(headers={"Authorization": f"Bearer {key}"})
            admitted, refused, retry_after = 0, 0, set()
            started = time.monotonic()
            while time.monotonic() - started < args.seconds:
                resp = client.get(url + "/v1/models")
                if resp.status_code == 200:
                    admitted += 1
                else:
                    refused += 1
                    retry_after.add(int(resp.headers["Retry-After"]))
            took = time.monotonic() - started
        finally:
            daemon.terminate()
            daemon.wait(60)
    print(json.dumps({
        "benchmark": "key_limits", "rpm": args.rpm, "seconds": round(took, 1),
        "admitted": admitted, "refused_429": refused,
        "expected_admitted": round(args.rpm + args.rpm * took / 60),
        "retry_after_values": sorted(retry_after),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
