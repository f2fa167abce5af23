"""``kunlun-cli batch run`` against a real daemon serving the tiny model.

SIGKILL halfway and resume (the daemon's request log proves no finished id was sent
again), a torn last line, bad input lines, a task file, and a 400 that is not retried.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.daemons import BIN, Daemon, settled_request_log

from kunlun.limits import CLIENT_GONE

NUM_LINES = 40
TASK = "kill40"
IN_FLIGHT = (None, CLIENT_GONE)
"""The status of a request in flight when its client was SIGKILLed: none sent yet, or 499
once the daemon saw the disconnect (before the whole body arrived, so no model was read)."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def request_log(daemon: Daemon) -> list[dict[str, Any]]:
    return settled_request_log(daemon.home)


def item_id(entry: dict[str, Any]) -> str:
    """The input id inside ``<task>:<id>:<attempt>``."""
    return str(entry["request_id"]).split(":")[1]


def batch_cmd(daemon: Daemon, inputs: Path, out: Path, *extra: str) -> list[str]:
    return [
        str(BIN / "kunlun-cli"),
        "batch",
        "run",
        "--endpoint",
        daemon.url,
        "--model-alias",
        "tiny",
        "--input-file",
        str(inputs),
        "--output-dir",
        str(out),
        *extra,
    ]


def write_inputs(path: Path) -> set[str]:
    lines = []
    for n in range(NUM_LINES):
        # long enough answers (ignore_eos) that the run is still going when it is killed
        line: dict[str, Any] = {"id": f"q{n}", "max_tokens": 48, "ignore_eos": True,
                                "temperature": 0}  # fmt: skip
        if n % 2:
            line["messages"] = [{"role": "user", "content": f"Say the number {n}."}]
        else:
            line["prompt"] = f"Counting: {n},"
        lines.append(json.dumps(line))
    path.write_text("\n".join(lines) + "\n")
    return {f"q{n}" for n in range(NUM_LINES)}


@pytest.fixture(scope="module")
def killed(
    tiny_daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """A 40-line run SIGKILLed once 10 results are written, then run again to the end."""
    daemon = tiny_daemon
    folder = tmp_path_factory.mktemp("batch-kill")
    inputs, out = folder / "prompts.jsonl", folder / "out"
    all_ids = write_inputs(inputs)
    cmd = batch_cmd(daemon, inputs, out, "--batch-size", "2", "--task-name", TASK)
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=daemon.env())
    results = out / "results.jsonl"
    deadline = time.monotonic() + 300
    while not (results.exists() and results.read_bytes().count(b"\n") >= 10):
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "no 10 results within 300 s"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert first.returncode == -signal.SIGKILL
    done_before = {str(r["id"]) for r in read_jsonl(results)}
    assert 10 <= len(done_before) < NUM_LINES
    log_mark = len(request_log(daemon))
    again = subprocess.run(cmd, capture_output=True, text=True, env=daemon.env(), timeout=600)
    yield {
        "daemon": daemon,
        "cmd": cmd,
        "out": out,
        "all_ids": all_ids,
        "done_before": done_before,
        "log_mark": log_mark,
        "again": again,
    }


def test_sigkill_then_rerun_finishes_each_id_exactly_once(killed: dict[str, Any]) -> None:
    again, out = killed["again"], killed["out"]
    assert again.returncode == 0, again.stderr
    assert f"{NUM_LINES}/{NUM_LINES} done ({len(killed['done_before'])} from an earlier run)" in (
        again.stdout
    )
    records = read_jsonl(out / "results.jsonl")
    ids = [str(r["id"]) for r in records]
    assert sorted(ids) == sorted(killed["all_ids"])  # every id, exactly once
    for record in records:
        assert isinstance(record["result"], str) and record["attempts"] == 1
        assert record["usage"]["completion_tokens"] >= 1 and record["latency_ms"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_done_before"] == len(killed["done_before"])
    assert summary["num_succeeded"] == NUM_LINES - len(killed["done_before"])
    assert summary["num_results"] == NUM_LINES and summary["complete"] is True
    assert summary["completion_tokens"] > 0 and summary["tokens_per_s"] > 0
    assert read_jsonl(out / "failures.jsonl") == []


def test_the_daemon_log_shows_no_finished_id_sent_again(killed: dict[str, Any]) -> None:
    entries = [
        e for e in request_log(killed["daemon"]) if str(e["request_id"]).startswith(f"{TASK}:")
    ]
    after = {
        item_id(e)
        for e in request_log(killed["daemon"])[killed["log_mark"] :]
        if str(e["request_id"]).startswith(f"{TASK}:")
    }
    assert after, "the rerun sent nothing"
    assert not after & killed["done_before"], "a finished id was sent again"
    assert after == killed["all_ids"] - killed["done_before"]
    for entry in entries:
        assert entry["method"] == "POST"
        assert entry["path"] in ("/v1/completions", "/v1/chat/completions")
        if entry["status"] in IN_FLIGHT:
            # in flight when the first run was SIGKILLed: its body may never have arrived
            assert entry["model"] in (None, "tiny")
        else:
            assert entry["model"] == "tiny", entry
    assert sum(e["status"] in IN_FLIGHT for e in entries) <= 2  # --batch-size 2 in flight
    finished = {item_id(e) for e in entries if e["status"] == 200}
    assert finished == killed["all_ids"]


def test_a_torn_last_line_is_discarded_and_its_id_run_again(killed: dict[str, Any]) -> None:
    daemon, out = killed["daemon"], killed["out"]
    results = out / "results.jsonl"
    lines = results.read_bytes().splitlines(keepends=True)
    torn_id = str(json.loads(lines[-1])["id"])
    results.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    mark = len(request_log(daemon))
    proc = subprocess.run(
        killed["cmd"], capture_output=True, text=True, env=daemon.env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    ids = [str(r["id"]) for r in read_jsonl(results)]
    assert sorted(ids) == sorted(killed["all_ids"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_torn_lines_discarded"] == 1
    assert summary["num_done_before"] == NUM_LINES - 1 and summary["num_succeeded"] == 1
    sent = [
        e["request_id"]
        for e in request_log(daemon)[mark:]
        if str(e["request_id"]).startswith(f"{TASK}:")
    ]
    assert sent == [f"{TASK}:{torn_id}:1"]


def test_bad_lines_are_reported_and_the_others_run(tiny_daemon: Daemon, tmp_path: Path) -> None:
    daemon = tiny_daemon
    inputs = tmp_path / "data" / "in.jsonl"
    inputs.parent.mkdir()
    inputs.write_text(
        '{"id": "a", "prompt": "Hello", "max_tokens": 4}\n'
        "{oops\n"
        '{"prompt": "no id", "max_tokens": 4}\n'
        '{"id": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}\n'
        '{"id": "a", "prompt": "again", "max_tokens": 4}\n'
        "\n"
        '{"id": 7, "prompt": "Seven", "max_tokens": 4}\n'
        '{"id": "hot", "prompt": "x", "max_tokens": 4, "temperature": 5}\n'
    )
    config = tmp_path / "task.yaml"
    config.write_text(
        "task_name: bad-input\nmodel_alias: tiny\ninput_file: data/in.jsonl\n"
        "output_dir: out\nbatch_size: 3\nmax_retries: 2\ntimeout_seconds: 120\n"
    )
    proc = subprocess.run(
        [str(BIN / "kunlun-cli"), "batch", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        env=daemon.env(KUNLUN_ENDPOINT=daemon.url),
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    out = tmp_path / "out"
    assert sorted(str(r["id"]) for r in read_jsonl(out / "results.jsonl")) == ["7", "a", "b"]
    assert any(r["id"] == 7 for r in read_jsonl(out / "results.jsonl"))  # kept as an integer
    failures = {f["line"]: f for f in read_jsonl(out / "failures.jsonl")}
    assert sorted(failures) == [2, 3, 5, 8]
    assert failures[2]["error"]["message"].startswith("not valid JSON")
    assert failures[3]["error"]["message"] == "missing 'id'"
    assert failures[5] == {
        "id": "a",
        "line": 5,
        "error": {"code": "input.invalid", "message": "id 'a' repeats line 1"},
    }
    hot = failures[8]
    assert hot["id"] == "hot" and hot["attempts"] == 1 and hot["error"]["status"] == 400
    assert "temperature" in hot["error"]["message"]
    sent = [e for e in request_log(daemon) if str(e["request_id"]).startswith("bad-input:")]
    assert sorted(e["request_id"] for e in sent) == [
        "bad-input:7:1",
        "bad-input:a:1",
        "bad-input:b:1",
        "bad-input:hot:1",
    ]
    assert next(e for e in sent if e["request_id"] == "bad-input:hot:1")["status"] == 400
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["num_bad_lines"], summary["num_failed"], summary["num_results"]) == (3, 1, 3)
    assert "3 bad input line(s)" in proc.stdout
