"""The declaration rules on recorded nodes, through the real CLIs.

Each test copies a shipped scenario from examples/nodes/, changes one thing an operator could
get wrong, and checks the verdict, the reason (with file:line) and the exit status.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODES = ROOT / "examples" / "nodes"
BIN = Path(sys.executable).parent


def probe(node: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(BIN / "kunlun-device-probe"),
            "--replay",
            str(node),
            "--config",
            str(node / "device-plugin-config.yaml"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def copy_node(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(NODES / name, target)
    return target


def line_of(path: Path, pattern: str, occurrence: int = 1) -> int:
    hits = [
        i + 1 for i, line in enumerate(path.read_text().splitlines()) if re.search(pattern, line)
    ]
    return hits[occurrence - 1]


@pytest.mark.parametrize(
    "name", ["ascend-910a-8x", "ascend-310", "amd-rx7800xt", "hygon-dcu", "mixed"]
)
def test_shipped_scenarios_probe_without_error(name: str) -> None:
    proc = probe(NODES / name, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    declared = {d["id"] for d in report["declarations"]}
    devices = {d["id"]: d for d in report["devices"]}
    assert declared <= set(devices)
    not_ready = {
        i: d["reasons"] for i, d in devices.items() if i in declared and d["status"] != "Ready"
    }
    if name == "ascend-910a-8x":  # the recorded server really has two chips in Warning
        assert set(not_ready) == {"ascend:3", "ascend:7"}
        assert proc.returncode == 1
    else:
        assert not_ready == {}
        assert proc.returncode == 0


def test_safe_degradation_for_a_short_topology_matrix(tmp_path: Path) -> None:
    """The seed's case: 4 Ascend 910B cards, topology rows of 3 entries."""
    node = copy_node("mixed", tmp_path)
    cfg = node / "device-plugin-config.yaml"
    text = cfg.read_text()
    for old, new in [
        ("[0, 5, 5, 5]", "[0, 5, 5]"),
        ("[5, 0, 5, 5]", "[5, 0, 5]"),
        ("[5, 5, 0, 5]", "[5, 5, 0]"),
        ("[5, 5, 5, 0]", "[5, 5, 5]"),
    ]:
        text = text.replace(old, new)
    cfg.write_text(text)
    proc = probe(node, "--json")
    assert proc.returncode == 1, proc.stderr
    devices = {d["id"]: d for d in json.loads(proc.stdout)["devices"]}
    excluded = devices["ascend:3"]
    assert excluded["status"] == "Excluded"
    line = line_of(cfg, r"topology_distance: \[5, 5, 5\]")
    assert f"{cfg}:{line} (topology_distance)" in excluded["reasons"][0]
    assert "safe degradation" in excluded["reasons"][0]
    for i in range(3):
        assert devices[f"ascend:{i}"]["status"] == "Degraded"
        assert devices[f"ascend:{i}"]["topology"] == [[0, 5, 5], [5, 0, 5], [5, 5, 0]][i]
    assert devices["cambricon:0"]["status"] == "Ready"  # other types are untouched


def test_declared_memory_above_probe_excludes(tmp_path: Path) -> None:
    node = copy_node("ascend-310", tmp_path)
    cfg = node / "device-plugin-config.yaml"
    cfg.write_text(cfg.read_text().replace("hbm_memory_mb: 8192", "hbm_memory_mb: 16384", 1))
    proc = probe(node, "--json")
    assert proc.returncode == 1
    dev = {d["id"]: d for d in json.loads(proc.stdout)["devices"]}["ascend:0"]
    assert dev["status"] == "Excluded"
    line = line_of(cfg, "hbm_memory_mb: 16384")
    reason = dev["reasons"][0]
    assert f"{cfg}:{line} (hbm_memory_mb)" in reason and "16384" in reason and "8192" in reason


def test_p2p_contradicted_by_topology_probe_degrades(tmp_path: Path) -> None:
    node = copy_node("ascend-910a-8x", tmp_path)
    topo = node / "npu-smi_info_-t_topo.txt"
    topo.write_text(re.sub(r"HCCS|PHB", "SYS", topo.read_text()))
    proc = probe(node, "--json")
    dev = {d["id"]: d for d in json.loads(proc.stdout)["devices"]}["ascend:0"]
    assert dev["status"] == "Degraded"
    assert dev["p2p_enabled"] is False
    assert any("p2p_enabled is declared true" in r for r in dev["reasons"])


def test_device_list_table_on_a_replayed_node() -> None:
    node = NODES / "ascend-910a-8x"
    proc = subprocess.run(
        [
            str(BIN / "kunlun-cli"),
            "device",
            "list",
            "--replay",
            str(node),
            "--config",
            str(node / "device-plugin-config.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Ascend 910A") == 8
    assert "ascend:3 vendor tool reports health 'Warning'" in proc.stdout


def test_doctor_on_a_replayed_node() -> None:
    proc = subprocess.run(
        [str(BIN / "kunlun-cli"), "doctor", "--replay", str(NODES / "mixed"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert (
        checks["ascend plugin"]["level"] == "ok"
        and "4 device(s)" in checks["ascend plugin"]["detail"]
    )
    assert checks["cambricon plugin"]["level"] == "ok"
    assert checks["nvidia plugin"]["level"] == "ok"
    assert (
        checks["metax plugin"]["level"] == "info"
        and "not found in the replay" in checks["metax plugin"]["detail"]
    )
    assert proc.returncode == 0
