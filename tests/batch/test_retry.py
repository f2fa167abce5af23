"""Retries against a real local HTTP server that answers 429, 5xx, slow, 400 and 401.

The server is a plain ``http.server`` on loopback that plays a script per input id and
records every request it receives (``X-Request-Id``, path, body, time). The client is the
real ``kunlun-cli batch run`` subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kunlun.batch.retry import RetryPolicy, is_retryable, retry_after_s

BIN = Path(sys.executable).parent

# id -> the answer to attempt 1, 2, ... (the last one repeats); "slow" sleeps past the timeout
SCRIPT: dict[str, list[Any]] = {
    "ok": [200],
    "rate": [429, 200],
    "flaky": [500, 503, 200],
    "slow": ["slow", 200],
    "bad": [400],
    "auth": [401],
    "down": [502],
}


class ScriptedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class ScriptedHandler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._reply(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request_id = self.headers["X-Request-Id"]
        with self.server.lock:
            self.server.seen.append(
                {
                    "request_id": request_id,
                    "path": self.path,
                    "body": body,
                    "t": time.monotonic(),
                    "auth": self.headers.get("Authorization"),
                }
            )
        _, item, attempt = request_id.split(":")
        plan = SCRIPT[item]
        action = plan[min(int(attempt), len(plan)) - 1]
        if action == "slow":
            time.sleep(2.5)
            action = 200
        if action == 200:
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            if self.path == "/v1/chat/completions":
                choice = {"message": {"role": "assistant", "content": f"re {item}"}}
            else:
                choice = {"text": f"re {item}"}
            choice["finish_reason"] = "length"
            self._reply(200, {"choices": [choice], "usage": usage})
            return
        error = {"error": {"message": f"scripted {action}", "type": "x", "code": f"c{action}"}}
        self._reply(action, error, {"Retry-After": "1"} if action == 429 else {})

    def _reply(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def run_cli(*args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUNLUN_")}
    if key:
        env["KUNLUN_API_KEY"] = key
    return subprocess.run(
        [str(BIN / "kunlun-cli"), "batch", "run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_retries_backoff_and_request_ids(server: ScriptedServer, tmp_path: Path) -> None:
    inputs = tmp_path / "in.jsonl"
    lines = [
        {"id": item, "prompt": f"p-{item}", "max_tokens": 4, "temperature": 0.5}
        for item in SCRIPT
        if item != "flaky"
    ]
    lines.append({"id": "flaky", "messages": [{"role": "user", "content": "x"}], "seed": 7})
    inputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = tmp_path / "task.yaml"
    config.write_text(
        "task_name: t\nmodel_alias: m\ninput_file: in.jsonl\noutput_dir: out\n"
        "batch_size: 4\nmax_retries: 0\ntimeout_seconds: 1\n"
    )
    # --max-retries on the command line overrides the file's 0
    proc = run_cli(
        "--config",
        str(config),
        "--endpoint",
        server.url + "/v1",
        "--max-retries",
        "2",
        key="kl-test-key",
    )
    assert proc.returncode == 1, proc.stderr  # some lines failed for good

    seen: dict[str, list[str]] = {}
    for request in server.seen:
        seen.setdefault(request["request_id"].split(":")[1], []).append(request["request_id"])
    expected_attempts = {"ok": 1, "rate": 2, "flaky": 3, "slow": 2, "bad": 1, "auth": 1, "down": 3}
    for item, attempts in expected_attempts.items():
        assert seen[item] == [f"t:{item}:{n}" for n in range(1, attempts + 1)], item

    out = tmp_path / "out"
    results = {r["id"]: r for r in read_jsonl(out / "results.jsonl")}
    assert sorted(results) == ["flaky", "ok", "rate", "slow"]
    for item, record in results.items():
        assert record["attempts"] == expected_attempts[item]
        assert record["result"] == f"re {item}"
        assert record["usage"]["completion_tokens"] == 2 and record["latency_ms"] > 0
    failures = {f["id"]: f for f in read_jsonl(out / "failures.jsonl")}
    assert sorted(failures) == ["auth", "bad", "down"]
    assert failures["bad"]["error"]["status"] == 400 and failures["bad"]["attempts"] == 1
    assert failures["auth"]["error"]["status"] == 401 and failures["auth"]["attempts"] == 1
    assert failures["down"]["error"] == {"status": 502, "code": "c502", "message": "scripted 502"}
    assert failures["down"]["attempts"] == 3 and failures["down"]["line"] == 6

    by_id = {r["request_id"]: r for r in server.seen}
    assert by_id["t:rate:2"]["t"] - by_id["t:rate:1"]["t"] >= 0.95  # Retry-After: 1 honoured
    assert by_id["t:flaky:1"]["path"] == "/v1/chat/completions"
    assert by_id["t:flaky:1"]["body"] == {
        "model": "m",
        "seed": 7,
        "messages": [{"role": "user", "content": "x"}],
    }
    assert by_id["t:ok:1"]["body"] == {
        "model": "m",
        "prompt": "p-ok",
        "max_tokens": 4,
        "temperature": 0.5,
    }
    assert {r["auth"] for r in server.seen} == {"Bearer kl-test-key"}

    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_succeeded"] == 4 and summary["num_failed"] == 3
    assert summary["num_retries"] == 1 + 2 + 1 + 2  # rate, flaky, slow, down
    assert summary["completion_tokens"] == 8 and summary["complete"] is False

    # a rerun only retries what failed (the server keeps its script per attempt number)
    server.seen.clear()
    again = run_cli("--config", str(config), "--endpoint", server.url, "--max-retries", "0")
    assert again.returncode == 1
    assert sorted(r["request_id"] for r in server.seen) == ["t:auth:1", "t:bad:1", "t:down:1"]
    assert len(read_jsonl(out / "results.jsonl")) == 4


def test_an_unserved_model_fails_at_once(server: ScriptedServer, tmp_path: Path) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"id": "ok", "prompt": "p"}\n')
    proc = run_cli(
        "--endpoint",
        server.url,
        "--model-alias",
        "nope",
        "--input-file",
        str(inputs),
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 2
    assert "model 'nope' is not served at" in proc.stderr and "served models: m" in proc.stderr
    assert server.seen == []


def test_an_unreachable_endpoint_exits_3(tmp_path: Path) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"id": "ok", "prompt": "p"}\n')
    proc = run_cli(
        "--endpoint",
        "http://127.0.0.1:9",
        "--model-alias",
        "m",
        "--input-file",
        str(inputs),
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 3 and "cannot reach" in proc.stderr


def test_policy() -> None:
    assert [is_retryable(s) for s in (None, 408, 429, 500, 503, 400, 401, 404, 422)] == [
        True,
        True,
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    assert retry_after_s("2") == 2.0 and retry_after_s(None) is None and retry_after_s("x") is None
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past
    policy = RetryPolicy(max_retries=5, base_delay_s=1.0, max_delay_s=4.0)
    for retry, (low, high) in {1: (0.5, 1.0), 2: (1.0, 2.0), 3: (2.0, 4.0), 6: (2.0, 4.0)}.items():
        delays = [policy.delay_s(retry) for _ in range(50)]
        assert all(low <= d <= high for d in delays) and len(set(delays)) > 1  # jittered
    assert policy.delay_s(1, retry_after=3.0) == 3.0
    assert policy.delay_s(1, retry_after=60.0) == 4.0
