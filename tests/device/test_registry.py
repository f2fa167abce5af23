"""Plugin discovery through entry points, and isolation of broken or hanging plugins.

A real package, installed with pip into a directory outside the source tree, registers three
plugins in ``kunlun.device_plugins``: one that works, one that raises and one that hangs. The
real CLIs run in a subprocess with that directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent

PLUGIN_SOURCE = '''
"""A third-party device plugin package, as a vendor would ship one."""
import time

from kunlun.device.plugin import DevicePlugin, Discovery, Health, ProbedDevice


class TestChipPlugin(DevicePlugin):
    device_type = "testchip"
    vendor = "Test Silicon"
    tools = ("testchip-smi",)
    visibility_env = "TESTCHIP_VISIBLE_DEVICES"
    torch_device_type = "testchip"

    def discover(self, tools):
        return Discovery([
            ProbedDevice("testchip", i, "TestChip T1", memory_total_mb=4096,
                         memory_used_mb=10, health=Health.OK)
            for i in range(2)
        ])


class BrokenPlugin(DevicePlugin):
    device_type = "brokenchip"
    vendor = "Broken"

    def discover(self, tools):
        raise RuntimeError("vendor library crashed")


class HangingPlugin(DevicePlugin):
    device_type = "hangchip"
    vendor = "Hang"

    def discover(self, tools):
        time.sleep(3600)
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("testchip-src")
    (src / "kunlun_testchip").mkdir()
    (src / "kunlun_testchip" / "__init__.py").write_text(PLUGIN_SOURCE)
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "kunlun-testchip"
            version = "1.0"

            [project.entry-points."kunlun.device_plugins"]
            testchip = "kunlun_testchip:TestChipPlugin"
            brokenchip = "kunlun_testchip:BrokenPlugin"
            hangchip = "kunlun_testchip:HangingPlugin"
            notaplugin = "kunlun_testchip:time"
            """
        )
    )
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(src),
        ],
        check=True,
    )
    return site


def run_cli(site: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(site), KUNLUN_PLUGIN_TIMEOUT_S="3")
    env.pop("KUNLUN_REPLAY_DIR", None)
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_installed_plugin_shows_in_device_list(plugin_site: Path) -> None:
    start = time.monotonic()
    proc = run_cli(plugin_site, "kunlun-cli", "device", "list", "--json")
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    devices = {d["id"]: d for d in json.loads(proc.stdout)}
    assert {"testchip:0", "testchip:1", "cpu:0"} <= set(devices)
    assert devices["testchip:1"]["status"] == "Ready"
    assert devices["testchip:1"]["memory_total_mb"] == 4096
    assert devices["testchip:1"]["visibility_env"] == "TESTCHIP_VISIBLE_DEVICES"
    # The hanging plugin (it sleeps an hour) is abandoned at its 3 s limit; the listing does
    # not wait for it. The bound is far above 3 s so that a loaded machine passes too.
    assert elapsed < 300


def test_broken_and_hanging_plugins_are_reported_not_fatal(plugin_site: Path) -> None:
    proc = run_cli(plugin_site, "kunlun-device-probe", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    plugins = {p["device_type"]: p for p in report["plugins"]}
    assert "vendor library crashed" in plugins["brokenchip"]["error"]
    assert "did not finish within 3s" in plugins["hangchip"]["error"]
    assert "not a DevicePlugin subclass" in plugins["notaplugin"]["error"]
    assert plugins["testchip"]["devices"] == ["testchip:0", "testchip:1"]
    assert plugins["cpu"]["error"] is None


def test_table_output_names_plugin_errors(plugin_site: Path) -> None:
    proc = run_cli(plugin_site, "kunlun-cli", "device", "list")
    assert proc.returncode == 0, proc.stderr
    assert "testchip:0" in proc.stdout
    assert "plugin brokenchip" in proc.stdout and "vendor library crashed" in proc.stdout


def test_bad_timeout_variable_is_a_clear_error(plugin_site: Path) -> None:
    env = dict(os.environ, KUNLUN_PLUGIN_TIMEOUT_S="soon")
    proc = subprocess.run(
        [str(BIN / "kunlun-cli"), "device", "list"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "KUNLUN_PLUGIN_TIMEOUT_S='soon'" in proc.stderr
