"""``--tp-size`` overrides the plan's tensor-parallel size, or is refused with the numbers."""

from __future__ import annotations

import json
from pathlib import Path

from tests.planner.test_plan_cli import cli, mixed

from kunlun.engine.tp_layout import head_split_problem


def test_tp_size_overrides_the_planned_size(tmp_path: Path) -> None:
    default = cli("--model", "Qwen2-0.5B", *mixed(), "--json", home=tmp_path)
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout)["plan"]["tensor_parallel_size"] == 1
    forced = cli("--model", "Qwen2-0.5B", "--tp-size", "2", *mixed(), "--json", home=tmp_path)
    assert forced.returncode == 0, forced.stderr
    plan = json.loads(forced.stdout)["plan"]
    assert plan["tensor_parallel_size"] == 2 and len(plan["devices"]) == 2


def test_tp_size_larger_than_the_device_classes_is_refused(tmp_path: Path) -> None:
    proc = cli("--model", "Llama-3-8B", "--tp-size", "8", *mixed(), home=tmp_path)
    assert proc.returncode == 2
    assert "tp=8 needs 8 devices; 4 in this class" in proc.stderr
    assert "tp=8 needs 8 devices; 2 in this class" in proc.stderr


def test_tp_size_the_heads_cannot_take_is_refused(tmp_path: Path) -> None:
    # Qwen2-0.5B: 14 query heads, 2 KV heads; 4 ranks put each KV head on 2 ranks, which
    # cannot split its 7 query heads
    proc = cli("--model", "Qwen2-0.5B", "--tp-size", "4", *mixed(), home=tmp_path)
    assert proc.returncode == 2
    assert "tp=4" in proc.stderr and "cannot split its 7 query heads" in proc.stderr
    assert head_split_problem(14, 2, 4) is not None and head_split_problem(14, 2, 2) is None
