"""Columns from the command line: names, references, pools, and the errors for bad input."""

from __future__ import annotations

import pytest

from kunlun.errors import ConfigError
from kunlun.validate.matrix import Column
from kunlun.validate.target import (
    cross_columns,
    normalize_endpoint,
    parse_target,
    pools_of,
    with_reference,
)

A, B = "http://127.0.0.1:8470", "http://10.0.0.2:9000"


def test_endpoints_are_normalized() -> None:
    assert normalize_endpoint("http://127.0.0.1:8470/v1/") == A
    assert normalize_endpoint(" http://h:1/proxy/bad ") == "http://h:1/proxy/bad"
    with pytest.raises(ConfigError, match="'localhost:8470' is not an http"):
        normalize_endpoint("localhost:8470")


def test_column_names_say_what_varies() -> None:
    assert [c.name for c in cross_columns([A], ["m"])] == ["m"]
    assert [c.name for c in cross_columns([A], ["fp32", "bf16"])] == ["fp32", "bf16"]
    assert [c.name for c in cross_columns([A, B], ["m"])] == ["127.0.0.1:8470", "10.0.0.2:9000"]
    pools = {(A, "m"): ["ascend", "cpu"]}
    columns = cross_columns([A], ["m"], pools)
    assert [(c.name, c.pool) for c in columns] == [("ascend", "ascend"), ("cpu", "cpu")]


def test_target_spec() -> None:
    assert parse_target(f"bf16={A}/v1,model=smollm2-bf16,pool=cpu", None) == Column(
        "bf16", A, "smollm2-bf16", "cpu"
    )
    assert parse_target(f"x={A}", "m").model == "m"
    with pytest.raises(ConfigError, match="NAME=URL"):
        parse_target(A, "m")
    with pytest.raises(ConfigError, match="unknown or empty option 'dtype=bf16'"):
        parse_target(f"x={A},dtype=bf16", "m")
    with pytest.raises(ConfigError, match="no model"):
        parse_target(f"x={A}", None)


def test_reference_by_name_by_url_or_new() -> None:
    columns = cross_columns([A], ["fp32", "bf16"])
    assert [(c.name, c.reference) for c in with_reference(columns, "bf16", None)] == [
        ("bf16", True),
        ("fp32", False),
    ]
    assert with_reference(columns, None, None)[0].name == "fp32"
    added = with_reference(columns, B, "fp32")
    assert (added[0].name, added[0].endpoint, added[0].reference) == ("reference", B, True)
    with pytest.raises(ConfigError, match="matches 2 columns"):
        with_reference(columns, A, "fp32")
    with pytest.raises(ConfigError, match="repeated: x"):
        with_reference([Column("x", A, "m"), Column("x", B, "m")], None, None)


def test_pools_are_device_types_of_running_workloads() -> None:
    workloads = [
        {"name": "m", "state": "RUNNING", "target_device": "cpu:0,ascend:1"},
        {"name": "m", "state": "FAILED", "target_device": "cambricon:0"},
        {"name": "other", "state": "RUNNING", "target_device": "nvidia:0"},
    ]
    assert pools_of(workloads, "m") == ["ascend", "cpu"]
    assert pools_of({"error": "x"}, "m") == []
