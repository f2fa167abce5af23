"""A tensor-parallel replica through the real daemon: two ranks sharing cpu:0 over gloo.

``--tp-size 2`` on the one-CPU node runs both ranks on cpu:0, splitting its cores. The replica
is ready when both ranks are; ``workload describe`` lists its ranks. A rank SIGKILLed in the
middle of a stream ends that stream with an SSE error event; the group restarts together and
the next request is answered. A size the heads cannot take is refused with the numbers.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tests.daemon.conftest import SPEC, Daemon, free_port, new_home, wait_ready

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tp_daemon(models_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(new_home(models_home, tmp_path_factory, "tp-home"), free_port())
    d.start(wait_ready=False)
    spec = d.home / "spec.yaml"
    spec.write_text(SPEC)
    made = d.cli("workload", "submit", "--file", str(spec), "--tp-size", "2", "--json")
    assert made.returncode == 0, made.stderr
    d.job = json.loads(made.stdout)["workload_id"]  # type: ignore[attr-defined]
    wait_ready(d)
    yield d
    d.stop()


def ranks_of(daemon: Daemon) -> list[dict]:
    return daemon.describe(daemon.job)["replicas"][0]["ranks"]  # type: ignore[attr-defined]


def test_tp2_replica_serves_and_lists_its_ranks(tp_daemon: Daemon) -> None:
    described = tp_daemon.describe(tp_daemon.job)  # type: ignore[attr-defined]
    assert described["placement"]["plan"]["tensor_parallel_size"] == 2
    ranks = ranks_of(tp_daemon)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["device"] == "cpu" for r in ranks) and ranks[0]["pid"] != ranks[1]["pid"]
    text = tp_daemon.cli("workload", "describe", tp_daemon.job)  # type: ignore[attr-defined]
    assert "rank 1: pid" in text.stdout and "tp 2" in text.stdout
    client = openai.OpenAI(base_url=tp_daemon.url + "/v1", api_key="none")
    resp = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=16, temperature=0
    )
    assert "Paris" in (resp.choices[0].message.content or "")


def test_a_rank_killed_mid_stream_restarts_the_group(tp_daemon: Daemon) -> None:
    job = tp_daemon.job  # type: ignore[attr-defined]
    before = tp_daemon.describe(job)["replicas"][0]
    follower = before["ranks"][1]["pid"]
    body = {"model": "smollm2", "prompt": "Write a long essay.", "max_tokens": 500,
            "stream": True, "ignore_eos": True}  # fmt: skip
    lines: list[str] = []
    with httpx.stream("POST", tp_daemon.url + "/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            lines.append(line)
            if len(lines) == 6:
                os.kill(follower, signal.SIGKILL)
    payloads = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "error" in payloads[-1], lines[-3:]
    assert "data: [DONE]" not in lines
    deadline = time.monotonic() + 240
    while not ((after := tp_daemon.describe(job))["replicas"][0]["pid"] != before["pid"]
               and after["replicas"][0]["ready"]):  # fmt: skip
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    wait_ready(tp_daemon, timeout=240)
    assert after["replicas"][0]["restarts"] == 1
    assert any("rank 1 of 2" in e["message"] for e in after["events"]) or "rank 1 of 2" in (
        tp_daemon.cli("workload", "logs", job).stdout
    )
    assert [r["rank"] for r in after["replicas"][0]["ranks"]] == [0, 1]
    assert follower not in {r["pid"] for r in after["replicas"][0]["ranks"]}
    client = openai.OpenAI(base_url=tp_daemon.url + "/v1", api_key="none")
    resp = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=16, temperature=0
    )
    assert "Paris" in (resp.choices[0].message.content or "")


def test_a_tp_size_the_heads_cannot_take_is_refused(tp_daemon: Daemon) -> None:
    # SmolLM2-135M: 9 query heads, 3 KV heads; 4 ranks cannot replicate 3 KV heads evenly
    planned = tp_daemon.cli("plan", "--model", "smollm2", "--tp-size", "4", remote=False)
    assert planned.returncode == 2, planned.stdout
    assert "tp=4" in planned.stderr and "num_key_value_heads=3" in planned.stderr
    refused = tp_daemon.cli(
        "workload", "submit", "--model", "smollm2", "--name", "tp4", "--tp-size", "4", "--dry-run"
    )
    assert refused.returncode == 2 and "num_key_value_heads=3" in refused.stderr
