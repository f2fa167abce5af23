"""The real CLIs on this machine: device list, kunlun-device-probe and doctor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

BIN = Path(sys.executable).parent
REQUIRED = {
    "id",
    "type",
    "name",
    "status",
    "memory_total_mb",
    "memory_used_mb",
    "reasons",
    "provenance",
}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.pop("KUNLUN_REPLAY_DIR", None)
    full_env.update(env or {})
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_cpu_only_machine_lists_host_cpu_ready_with_real_memory() -> None:
    proc = run("kunlun-cli", "device", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    devices = json.loads(proc.stdout)
    cpu = next(d for d in devices if d["id"] == "cpu:0")
    assert REQUIRED <= set(cpu)
    assert cpu["status"] == "Ready"
    total_mb = psutil.virtual_memory().total // (1024 * 1024)
    assert cpu["memory_total_mb"] == total_mb
    assert 0 < cpu["memory_used_mb"] < total_mb
    assert cpu["provenance"]["memory_total_mb"] == "probed"
    assert "fp32" in cpu["supported_dtypes"]


def test_table_has_the_columns() -> None:
    proc = run("kunlun-cli", "device", "list")
    assert proc.returncode == 0, proc.stderr
    for column in ("ID", "TYPE", "NAME", "STATUS", "MEMORY", "UTILIZATION", "TOPOLOGY"):
        assert column in proc.stdout
    assert "cpu:0" in proc.stdout and "Ready" in proc.stdout


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "device-plugin-config.yaml"
    path.write_text(text)
    return path


def test_probe_exit_codes(tmp_path: Path) -> None:
    total_mb = psutil.virtual_memory().total // (1024 * 1024)
    ok = write(
        tmp_path,
        f"devices:\n  - device_type: cpu\n    device_id: 0\n    total_memory_mb: {total_mb // 2}\n",
    )
    proc = run("kunlun-device-probe", "--config", str(ok), "--verbose")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for step in ("Step 1", "Step 2", "Step 3", "Step 4"):
        assert step in proc.stdout
    assert f"{ok}:2 cpu:0" in proc.stdout
    assert "memory_total_mb:validated" in proc.stdout

    too_big = write(
        tmp_path,
        f"devices:\n  - device_type: cpu\n    device_id: 0\n    total_memory_mb: {total_mb * 4}\n",
    )
    proc = run("kunlun-device-probe", "--config", str(too_big))
    assert proc.returncode == 1
    assert "Excluded" in proc.stdout and f"{too_big}:4 (total_memory_mb)" in proc.stdout

    missing = write(tmp_path, "devices:\n  - device_type: cpu\n    device_id: 3\n")
    proc = run("kunlun-device-probe", "--config", str(missing), "--json")
    assert proc.returncode == 1
    cpu3 = next(d for d in json.loads(proc.stdout)["devices"] if d["id"] == "cpu:3")
    assert cpu3["status"] == "Excluded" and "declared but not found" in cpu3["reasons"][0]

    bad = write(tmp_path, "devices:\n  - device_type: tpu\n    device_id: 0\n")
    proc = run("kunlun-device-probe", "--config", str(bad))
    assert proc.returncode == 2
    assert f"{bad}:2 (device_type)" in proc.stderr and "known:" in proc.stderr


@pytest.mark.parametrize(
    "args", [["--config", "/nonexistent.yaml"], ["--replay", "/nonexistent-dir"]]
)
def test_missing_paths_are_clear_errors(args: list[str]) -> None:
    proc = run("kunlun-cli", "device", "list", *args)
    assert proc.returncode == 2
    assert "/nonexistent" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error [config.invalid] ")  # the code, not a style tag


def test_replay_env_variable_is_honoured(tmp_path: Path) -> None:
    replay = tmp_path / "node"
    replay.mkdir()
    (replay / "lscpu.txt").write_text(
        "Architecture: aarch64\nCPU(s): 64\nModel name: Neoverse-V2\nFlags: fp asimd bf16 i8mm\n"
    )
    (replay / "free_-m.txt").write_text(
        "              total  used  free\nMem:  515000  1200  510000\n"
    )
    proc = run("kunlun-cli", "device", "list", "--json", env={"KUNLUN_REPLAY_DIR": str(replay)})
    assert proc.returncode == 0, proc.stderr
    (cpu,) = [d for d in json.loads(proc.stdout) if d["type"] == "cpu"]
    assert cpu["name"] == "Neoverse-V2"
    assert cpu["memory_total_mb"] == 515000 and cpu["memory_used_mb"] == 1200
    assert cpu["supported_dtypes"] == ["fp32", "bf16", "int8"]
    assert cpu["attributes"]["bf16_native"] == "yes"


def test_doctor_on_this_machine_reports_every_vendor_tool() -> None:
    proc = run("kunlun-cli", "doctor", "--json")
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    names = {c["name"] for c in report["checks"]}
    assert "kernel" in names
    assert "cpu plugin" in names and "nvidia plugin" in names and "ascend plugin" in names
    areas = {c["area"] for c in report["checks"]}
    assert {"system", "devices", "drivers", "container", "network", "python"} <= areas
    assert any(c["name"].startswith("port ") for c in report["checks"])
    text = run("kunlun-cli", "doctor")
    assert "Kunlun doctor" in text.stdout
