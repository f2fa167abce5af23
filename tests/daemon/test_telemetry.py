"""Telemetry of a real daemon serving the tiny model, with an API key: /metrics, a real
Prometheus server scraping it with the key as bearer token, ``kunlun-cli telemetry metrics``,
and the Chrome trace of a workload with ``advanced_profiling`` on."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests import loopback
from tests.daemons import BIN, TINY, Daemon, Profile, daemon_fixture, free_port

PROFILED = "telemetry:\n  advanced_profiling: true\n  profiling_interval_ms: 0\ndtype: fp32\n"
"""Profiling on; float32, so the worker runs the compiled decode step (kunlun.engine.native)
on every CPU (a bf16 plan runs the reference path)."""


profiled = daemon_fixture(Profile(
    "telemetry-home", (TINY + PROFILED,),
    env=(("KUNLUN_TELEMETRY_INTERVAL_S", "1"),),  # device samples every second
))  # fmt: skip


@pytest.fixture(scope="module")
def keyed(profiled: Daemon) -> tuple[Daemon, str]:
    """The daemon serving the tiny model with profiling on, then given an API key (made
    through the daemon, which has none until then)."""
    return profiled, profiled.create_key("prometheus", "--scope", "admin", remote=True)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        value
        for (n, ls), value in samples(text).items()
        if n == name and labels.items() <= dict(ls).items()
    )


def metrics(
    daemon: Daemon, key: str, until: tuple[str, dict[str, str], float] | None = None
) -> str:
    """The daemon's exposition; with ``until=(name, labels, minimum)``, the first one (within
    30 s) where that sum reached the minimum: a request is counted when the gateway has
    finished with it, which may be just after the client has the whole answer."""
    deadline = time.monotonic() + 30
    while True:
        response = daemon.get("/metrics", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        if until is None or total(response.text, until[0], **until[1]) >= until[2]:
            return response.text
        if time.monotonic() > deadline:
            lines = [line for line in response.text.splitlines() if until[0] in line]
            pytest.fail(f"{until} not reached: {lines}")
        time.sleep(0.1)


def chat(daemon: Daemon, key: str, count: int) -> None:
    """``count`` chat completions, every other one streamed (and read to its end)."""
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=key, max_retries=0)
    question = [{"role": "user", "content": "Say hello."}]
    for i in range(count):
        if i % 2:
            stream = client.chat.completions.create(
                model="tiny", messages=question, max_tokens=4, stream=True
            )
            assert [chunk for chunk in stream]
        else:
            reply = client.chat.completions.create(model="tiny", messages=question, max_tokens=4)
            assert reply.choices


def test_metrics_need_the_key_and_describe_the_platform(keyed: tuple[Daemon, str]) -> None:
    daemon, key = keyed
    assert daemon.get("/metrics").status_code == 401
    assert daemon.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    chat(daemon, key, 2)
    missing = loopback.post(
        daemon.url + "/v1/chat/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "nope", "messages": []},
    )
    assert missing.status_code == 404
    replica = f"{daemon.job}-r0"
    mine = {"model": "tiny", "replica": replica, "priority": "normal"}
    text = metrics(daemon, key, until=("kunlun_requests_total", {"status": "200", **mine}, 2))
    assert total(text, "kunlun_replica_info", device="cpu:0", device_type="cpu", **mine) == 1
    assert total(text, "kunlun_replica_ready", **mine) == 1
    assert total(text, "kunlun_replica_restarts_total", **mine) == 0
    assert total(text, "kunlun_replica_scrape_up", **mine) == 1
    startup = {
        dict(labels)["phase"]: value
        for (name, labels), value in samples(text).items()
        if name == "kunlun_replica_startup_seconds"
    }
    assert set(startup) == {"compile", "load", "warmup_ttft", "total"}
    assert startup["compile"] >= 0 and startup["warmup_ttft"] > 0
    assert startup["total"] > startup["load"] > 0  # process start to ready includes the load
    assert total(text, "kunlun_requests_total", status="200", **mine) >= 2
    assert total(text, "kunlun_requests_total", model="-", status="404") == 1
    assert total(text, "kunlun_time_to_first_token_seconds_count", **mine) >= 2  # from the worker
    assert total(text, "kunlun_kv_cache_blocks", device="cpu:0", **mine) > 0
    assert total(text, "kunlun_device_memory_total_bytes", device="cpu:0", device_type="cpu") > 0
    assert total(text, "kunlun_device_status", device="cpu:0", status="Ready") == 1
    platform_rss = total(text, "kunlun_platform_resident_memory_bytes")
    worker_rss = total(text, "kunlun_process_resident_memory_bytes", process="worker")
    daemon_rss = total(text, "kunlun_process_resident_memory_bytes", process="daemon")
    assert platform_rss >= worker_rss + daemon_rss > 0


def start_prometheus(folder: Path, daemon: Daemon, key: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (Debian package 'prometheus')")
    target = f"127.0.0.1:{daemon.port}"
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "kunlun",
                "authorization": {"credentials": key},
                "static_configs": [{"targets": [target]}],
            },
            {
                "job_name": "kunlun-wrong-key",
                "authorization": {"credentials": "wrong"},
                "static_configs": [{"targets": [target]}],
            },
        ],
    }
    (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = (folder / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited: {(folder / 'prometheus.log').read_text()}")
        try:
            if loopback.get(url + "/-/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"prometheus not ready: {(folder / 'prometheus.log').read_text()}")


def query(url: str, promql: str) -> list[dict[str, Any]]:
    body = loopback.get(url + "/api/v1/query", params={"query": promql}, timeout=10).json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def wait_for(url: str, promql: str, wanted: float, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        seen = query(url, promql)
        if seen and float(seen[0]["value"][1]) == wanted:
            return
        time.sleep(0.5)
    pytest.fail(f"{promql} never became {wanted}; last answer {seen}")


def test_real_prometheus_reads_the_ttft_histogram(
    keyed: tuple[Daemon, str], tmp_path: Path
) -> None:
    daemon, key = keyed
    ttft_count = 'sum(kunlun_time_to_first_token_seconds_count{model="tiny"})'
    before = total(metrics(daemon, key), "kunlun_time_to_first_token_seconds_count", model="tiny")
    proc, url = start_prometheus(tmp_path, daemon, key)
    try:
        wait_for(url, 'up{job="kunlun"}', 1)  # scraped with the key as bearer token
        wait_for(url, ttft_count, before)
        chat(daemon, key, 3)
        wait_for(url, ttft_count, before + 3)  # read back through the HTTP query API
        wait_for(url, 'up{job="kunlun-wrong-key"}', 0)  # the daemon refuses a wrong key
        median = query(
            url, "histogram_quantile(0.5, sum by (le) (kunlun_time_to_first_token_seconds_bucket))"
        )
        assert 0 < float(median[0]["value"][1]) < 60
        cpu = query(url, 'kunlun_device_memory_total_bytes{device_type="cpu"}')
        assert cpu and cpu[0]["metric"]["device"] == "cpu:0"
    finally:
        proc.terminate()
        proc.wait(30)


def test_cli_telemetry_metrics(keyed: tuple[Daemon, str]) -> None:
    daemon, key = keyed
    proc = daemon.cli("telemetry", "metrics", "--filter", "device_type=cpu", "--json", key=key)
    assert proc.returncode == 0, proc.stderr
    view = json.loads(proc.stdout)
    assert [d["device"] for d in view["devices"]] == ["cpu:0"]
    (row,) = view["replicas"]
    assert (row["model"], row["device_type"], row["ready"]) == ("tiny", "cpu", 1)
    assert row["requests"]["200"] >= 2 and row["ttft_count"] >= 2
    assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
    # the step profiler's figure: decode steps' time by part, in the sandboxed worker
    assert row["decode_path"] == "compiled" and row["decode_steps"] >= 1
    assert row["decode_engine_s"] > 0 and row["decode_compiled_s"] > 0
    none = daemon.cli("telemetry", "metrics", "--filter", "device_type=ascend", "--json", key=key)
    assert json.loads(none.stdout)["devices"] == [] and json.loads(none.stdout)["replicas"] == []
    table = daemon.cli("telemetry", "metrics", key=key)
    assert table.returncode == 0, table.stderr
    for word in ("Devices", "cpu:0", "Replicas", "tiny", "TTFT ms p50/p99", "platform memory",
                 "Decode steps", "compiled"):  # fmt: skip
        assert word in table.stdout
    bad = daemon.cli("telemetry", "metrics", "--filter", "device_type", key=key)
    assert bad.returncode == 2 and "'device_type' is not LABEL=VALUE" in bad.stderr
    unauthorized = daemon.cli("telemetry", "metrics")
    assert unauthorized.returncode != 0 and "401" in unauthorized.stderr


def test_cli_telemetry_watch(keyed: tuple[Daemon, str]) -> None:
    daemon, key = keyed
    env = daemon.env(KUNLUN_ENDPOINT=daemon.url, KUNLUN_API_KEY=key)
    command = [
        str(BIN / "kunlun-cli"),
        "telemetry",
        "metrics",
        "--watch",
        "--json",
        "--interval",
        "0.3",
    ]
    # Started as a non-interactive shell starts a background job: SIGINT set to "ignore".
    # The watch must stop on SIGINT all the same.
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    snapshots = [json.loads(line) for line in lines]
    assert all(s["devices"] and s["replicas"] for s in snapshots)
    times = [s["devices"][0]["sampled_at"] for s in snapshots]
    assert times[0] <= times[1]


def test_advanced_profiling_writes_a_chrome_trace(keyed: tuple[Daemon, str]) -> None:
    """Runs last: stops the workload, so its worker closes the trace."""
    daemon, key = keyed
    chat(daemon, key, 1)
    job = daemon.job
    assert job is not None
    logs = daemon.cli("workload", "logs", job, key=key)
    assert "Advanced profiling: engine steps traced to" in logs.stdout
    assert re.search(r"Decode path: compiled \(compiled decode library .*\.so\)", logs.stdout)
    stopped = daemon.cli("workload", "stop", job, key=key)
    assert stopped.returncode == 0, stopped.stderr
    (trace,) = (daemon.home / "logs" / "traces").glob(f"{job}-r0.*.trace.json")
    events = json.loads(trace.read_text())
    steps = [e for e in events if e["name"] == "step"]
    assert len(steps) >= 4  # profiling_interval_ms 0: every step of every request
    assert {e["name"] for e in events} >= {"schedule", "prepare", "forward", "sample", "detokenize"}
    assert all(e["args"]["batch_size"] >= 1 for e in steps)
    assert os.path.getsize(trace) > 0
