"""Request routing on a real daemon serving the tiny model: priority classes from the
workload, the API key and ``X-Kunlun-Priority``; pools by ``X-Kunlun-Pool``;
``X-Kunlun-Device`` on every answer; ``scheduler_config.yaml`` reloaded live and on SIGHUP."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import openai
import pytest
from tests import loopback
from tests.daemons import TINY, Daemon, Profile, daemon_fixture, refused

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Routed:
    def __init__(self, daemon: Daemon, high_key: str, plain_key: str) -> None:
        self.daemon, self.high_key, self.plain_key = daemon, high_key, plain_key

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.daemon.url + "/v1", api_key=key, max_retries=0, timeout=120
        )


low_priority = daemon_fixture(Profile(
    "routing-home", (TINY + "priority: low\n",), keys=(("plain", "admin"),),
    files=(("scheduler_config.yaml", "policy: round-robin\n"),),
))  # fmt: skip


@pytest.fixture(scope="module")
def routed(low_priority: Daemon) -> Routed:
    d = low_priority
    high_key = d.create_key("batch-high", "--priority", "high")  # on the home, as "plain"
    deadline = time.monotonic() + 60  # the daemon rereads its keys within 0.25 s
    while d.get("/v1/models", headers={"Authorization": f"Bearer {high_key}"}).is_error:
        assert time.monotonic() < deadline, "the running daemon never took the new key"
        time.sleep(0.1)
    return Routed(d, high_key, d.keys["plain"])


def ask(client: openai.OpenAI, **headers: str) -> dict[str, str]:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=QUESTION, max_tokens=2, temperature=0, extra_headers=headers
    )
    assert raw.parse().choices
    return {k: raw.headers[k] for k in ("x-kunlun-priority", "x-kunlun-device")}


def test_priority_comes_from_header_then_key_then_workload(routed: Routed) -> None:
    plain, high = routed.client(routed.plain_key), routed.client(routed.high_key)
    assert ask(plain) == {"x-kunlun-priority": "low", "x-kunlun-device": "cpu:0"}  # workload
    assert ask(high)["x-kunlun-priority"] == "high"  # the key's
    assert ask(high, **{"X-Kunlun-Priority": "normal"})["x-kunlun-priority"] == "normal"
    assert ask(plain, **{"X-Kunlun-Priority": "HIGH"})["x-kunlun-priority"] == "high"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(plain, **{"X-Kunlun-Priority": "urgent"})
    error = caught.value.body
    assert error["param"] == "X-Kunlun-Priority"
    assert "X-Kunlun-Priority" in error["message"] and "'urgent'" in error["message"]


def test_pool_header_restricts_to_a_device_type(routed: Routed) -> None:
    plain = routed.client(routed.plain_key)
    assert ask(plain, **{"X-Kunlun-Pool": "cpu"})["x-kunlun-device"] == "cpu:0"
    headers = {"Authorization": f"Bearer {routed.plain_key}", "X-Kunlun-Pool": "cpu"}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "stream": True}
    with loopback.stream("POST", routed.daemon.url + "/v1/completions", json=body,
                      headers=headers, timeout=120) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["x-kunlun-device"] == "cpu:0"
        assert "[DONE]" in response.read().decode()
    for pool in ("ascend", ""):
        with pytest.raises(openai.NotFoundError) as caught:
            ask(plain, **{"X-Kunlun-Pool": pool})
        error = caught.value.body
        assert error["code"] == "pool_not_found" and error["param"] == "X-Kunlun-Pool"
        assert f"pool {pool!r}" in error["message"] and "pools serving it: cpu" in error["message"]


def test_apikey_priority_is_stored_listed_and_validated(routed: Routed) -> None:
    listed = routed.daemon.cli("apikey", "list", "--json", key=routed.plain_key)
    assert listed.returncode == 0, listed.stderr
    priorities = {k["name"]: k["priority"] for k in json.loads(listed.stdout)}
    assert priorities == {"batch-high": "high", "plain": None}
    table = routed.daemon.cli("apikey", "list", key=routed.plain_key)
    assert "PRIORITY" in table.stdout and "high" in table.stdout
    bad = routed.daemon.cli("apikey", "create", "x", "--priority", "urgent", key=routed.plain_key)
    assert bad.returncode == 2
    assert "'urgent'" in bad.stderr + bad.stdout


def test_scheduler_config_reloads_live_and_a_bad_one_keeps_the_old(routed: Routed) -> None:
    daemon, plain = routed.daemon, routed.client(routed.plain_key)
    path = daemon.home / "scheduler_config.yaml"

    def save(text: str) -> None:
        path.write_text(text)
        stamp = time.time_ns() + 1_000_000_000  # a later modification time, whatever the clock
        os.utime(path, ns=(stamp, stamp))

    def logged(text: str, count: int = 1, timeout_s: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while daemon.log().count(text) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    save("policy: load-aware\nmin_gpu_utilization_threshold: 70\n")
    assert logged(f"{path}:2 (min_gpu_utilization_threshold)"), daemon.log()
    assert "previous one stays in force" in daemon.log()
    assert ask(plain)["x-kunlun-device"] == "cpu:0"  # still serving

    save("policy: load-aware\nmin_gpu_utilization_threshold: 0.9\n")
    assert logged("scheduler config reloaded"), daemon.log()
    daemon.signal(signal.SIGHUP)
    assert logged("scheduler config reloaded", count=2), daemon.log()
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert ask(plain)["x-kunlun-device"] == "cpu:0"


def test_a_bad_scheduler_config_stops_the_daemon_from_starting(tmp_path: Path) -> None:
    bad = tmp_path / "sched.yaml"
    bad.write_text("policy: round-robin\nqueue_limits:\n  hihg: 3\n")
    proc = refused(tmp_path / "home", "--scheduler-config", str(bad))
    assert proc.returncode == 2
    output = proc.stdout + proc.stderr
    assert f"{bad}:3 (queue_limits.hihg)" in output and "did you mean 'high'" in output
