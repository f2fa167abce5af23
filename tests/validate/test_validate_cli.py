"""``kunlun-cli validate`` on bad input and on a target that is down (no daemon needed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNLUN_")}
    return subprocess.run([str(BIN / "kunlun-cli"), "validate", *args], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when this returns


def test_bad_arguments_exit_2_naming_the_problem(tmp_path: Path) -> None:
    proc = run("--target", "http://127.0.0.1:8470", "--model", "m", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "--target (http://127.0.0.1:8470): expected NAME=URL" in proc.stderr
    proc = run("--endpoint", "http://127.0.0.1:1", "--model", "m", "--only", "api.ssse",
               "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode == 2 and "unknown check(s) api.ssse; known: " in proc.stderr
    assert "api.sse" in proc.stderr
    proc = run("--endpoint", "http://127.0.0.1:1", "--out", str(tmp_path))
    assert proc.returncode == 2 and "which model? give --model M" in proc.stderr
    baseline = tmp_path / "old.json"
    baseline.write_text(json.dumps({"format": 0}))
    proc = run("--endpoint", "http://127.0.0.1:1", "--model", "m", "--baseline", str(baseline))
    assert proc.returncode == 2 and f"{baseline} (format): not a validation run" in proc.stderr


def test_a_target_that_is_down_fails_every_row_at_once(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    proc = run("--endpoint", url, "--model", "m", "--only", "api", "--out", str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    run_ = json.loads((tmp_path / "validation.json").read_text())
    cells = run_["cells"]["m"]
    assert len(cells) == 18 and {c["status"] for c in cells.values()} == {"FAIL"}
    assert all(
        c["figure"] == "unreachable" and "ConnectError" in c["detail"] for c in cells.values()
    )
    assert "FAIL api.sse on m: GET " in proc.stdout
