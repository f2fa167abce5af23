"""``scheduler_config.yaml``: validation with file:line and field, live reload that keeps the
previous config when the new file is bad."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kunlun.errors import ConfigError
from kunlun.serving.admission import Admission, Ticket
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.serving.routing import DeviceSamples, Router
from kunlun.serving.scheduler_config import (
    SchedulerConfig,
    SchedulerConfigSource,
    load_scheduler_config,
    parse_scheduler_config,
)

GOOD = """\
policy: round-robin
min_gpu_utilization_threshold: 0.8
priority_weights:
  high: 5
queue_limits: {low: 16}
max_queue_wait_s: 12.5
thermal:
  limit_c: 80
"""


def write(path: Path, text: str) -> None:
    """Write ``text`` and move the modification time on, as an editor saving later would."""
    path.write_text(text)
    stamp = path.stat().st_mtime_ns + 1_000_000_000
    os.utime(path, ns=(stamp, stamp))


def test_every_field_is_read(tmp_path: Path) -> None:
    path = tmp_path / "scheduler_config.yaml"
    path.write_text(GOOD)
    config = load_scheduler_config(path)
    assert config.policy == "round-robin"
    assert config.min_gpu_utilization_threshold == 0.8
    assert (config.priority_weights.high, config.priority_weights.normal) == (5, 2)
    assert (config.queue_limits.low, config.queue_limits.high) == (16, 256)
    assert config.max_queue_wait_s == 12.5
    assert (config.thermal.limit_c, config.thermal.duration_s) == (80, 30)


def test_empty_or_missing_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "scheduler_config.yaml"
    path.write_text("# nothing set\n")
    assert load_scheduler_config(path) == SchedulerConfig()
    source = SchedulerConfigSource(tmp_path / "absent.yaml")
    assert source.load() == SchedulerConfig()
    assert source.config.policy == "load-aware"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("policy: fastest\n", ["scheduler_config.yaml:1 (policy)", "'fastest'"]),
        (
            "policy: load-aware\nmin_gpu_utilization_threshold: 70\n",
            ["scheduler_config.yaml:2 (min_gpu_utilization_threshold)", "0.7 means 70", "70"],
        ),
        (
            "thermal:\n  limit_c: 85\n  duration: 30\n",
            ["scheduler_config.yaml:3 (thermal.duration)", "did you mean 'duration_s'"],
        ),
        (
            "queue_limits:\n  high: -1\n",
            ["scheduler_config.yaml:2 (queue_limits.high)", "-1"],
        ),
        (
            "policy: load-aware\nmax_queue_wait_s: 0\n",
            ["scheduler_config.yaml:2 (max_queue_wait_s)", "greater than 0", "0"],
        ),
        ("polcy: round-robin\n", ["scheduler_config.yaml:1 (polcy)", "did you mean 'policy'"]),
        ("policy: [round-robin\n", ["scheduler_config.yaml:2", "not valid YAML"]),
        ("- policy\n", ["scheduler_config.yaml:1", "must be a mapping"]),
        (
            "policy: load-aware\napi_keys:\n  allow_ips: [10.0.0.0/8, intranet]\n",
            ["scheduler_config.yaml:3 (api_keys.allow_ips)", "'intranet'"],
        ),
        ("api_keys: {rpm: 0}\n", ["scheduler_config.yaml:1 (api_keys.rpm)", "0"]),
        ("model_roots: [models]\n", ["scheduler_config.yaml:1 (model_roots)", "'models'"]),
    ],
)
def test_errors_name_file_line_field_and_value(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    path = tmp_path / "scheduler_config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_scheduler_config(path)
    for part in expected:
        assert part in str(caught.value), str(caught.value)


def test_reload_takes_a_changed_file_and_keeps_the_old_config_on_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "scheduler_config.yaml"
    path.write_text("policy: load-aware\n")
    source = SchedulerConfigSource(path, check_interval_s=0.0)
    source.load()
    assert not source.poll()  # unchanged

    write(path, GOOD)
    assert source.poll()
    assert source.config.policy == "round-robin" and source.last_error is None

    write(path, "policy: round-robin\nthermal:\n  limit_c: hot\n")
    with caplog.at_level(logging.ERROR, logger="kunlun.serving.scheduler_config"):
        assert not source.poll()
    assert source.config == parse_scheduler_config(GOOD, "inline")  # the previous one stays
    assert source.last_error is not None
    assert "scheduler_config.yaml:3 (thermal.limit_c)" in str(source.last_error)
    assert "scheduler_config.yaml:3 (thermal.limit_c)" in caplog.text
    assert "previous one stays in force" in caplog.text
    assert not source.poll()  # the same bad file is reported once

    write(path, "policy: load-aware\n")
    assert source.poll()
    assert source.config.policy == "load-aware" and source.last_error is None


def test_poll_looks_at_the_file_at_most_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "scheduler_config.yaml"
    path.write_text("policy: load-aware\n")
    source = SchedulerConfigSource(path)
    source.load()
    source.poll()
    write(path, "policy: round-robin\n")
    assert not source.poll() and source.config.policy == "load-aware"  # within the second
    assert source.reload() and source.config.policy == "round-robin"  # SIGHUP: at once


def test_the_router_follows_a_reloaded_policy(tmp_path: Path) -> None:
    path = tmp_path / "scheduler_config.yaml"
    path.write_text("policy: load-aware\n")
    source = SchedulerConfigSource(path, check_interval_s=0.0)
    source.load()
    replicas = ReplicaSet()
    busy = Replica("r0", "w", "m", "cpu:0", "", ready=True, outstanding_tokens=5000)
    idle = Replica("r1", "w", "m", "cpu:1", "", ready=True)
    replicas.upsert(busy)
    replicas.upsert(idle)
    admission = Admission(replicas, Router(source, DeviceSamples()))

    def chosen(num: int) -> list[str]:
        out = []
        for _ in range(num):
            ticket = Ticket("m", "normal", None, 10)
            replica = admission.try_admit(ticket)
            assert replica is not None
            out.append(replica.replica_id)
            admission.release(ticket)
        return out

    assert chosen(4) == ["r1"] * 4
    write(path, "policy: round-robin\n")
    source.poll()
    assert sorted(chosen(4)) == ["r0", "r0", "r1", "r1"]
