"""The whole offline chain on loopback with no network: pack and bundle on this (connected)
machine, then inside ``unshare -n`` install the bundle into a fresh directory with the
installer from the bundle, install the package with the installed installer, start the platform with ``--require-signed``
and get a chat answer from the packaged model. The stages are tests of their own (pack and
bundle, install, package, serve), each in order on the same folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.daemons import free_port
from tests.offline.conftest import run

AIRGAP = Path(__file__).with_name("airgap.py")


def namespace_command() -> list[str]:
    """``unshare -n`` (root) or ``unshare -rn`` (a user namespace), whichever works here."""
    for cmd in (["unshare", "-n"], ["unshare", "-rn"]):
        if shutil.which("unshare") and subprocess.run([*cmd, "true"]).returncode == 0:
            return cmd
    pytest.skip("cannot make a network namespace here (unshare -n and -rn both fail)")


@pytest.fixture(scope="module")
def packed(demo_fp32: Path, keys: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The connected half: the demo model packed and the platform bundled, signed, into a
    folder that is all the air-gapped half gets (with the public key). Removed at the end:
    with the installed prefix it holds GBs."""
    base = tmp_path_factory.mktemp("airgap")
    work = base / "work"
    (work / "keys").mkdir(parents=True)
    shutil.copy(keys / "kunlun-signing.pub", work / "keys")
    key = str(keys / "kunlun-signing.key")
    run("kunlun-cli", "model", "pack", "--model", str(demo_fp32), "--target-device", "cpu:0",
        "--key", key, "-o", str(work / "model.kunlunpkg"), home=base / "packer")  # fmt: skip
    run("kunlun-installer", "bundle", "-o", str(work / "kunlun-offline.tar"), "--key", key,
        home=base / "packer")  # fmt: skip
    yield work
    shutil.rmtree(base)


def test_the_connected_half_packs_the_demo_and_bundles_the_platform(
    packed: Path, tmp_path: Path
) -> None:
    """Its own test, so the pack and bundle (the module's fixture) and the air-gapped half
    below are timed apart."""
    info = json.loads(run("kunlun-cli", "model", "inspect", str(packed / "model.kunlunpkg"),
                          "--json", home=tmp_path / "reader").stdout)  # fmt: skip
    assert info["license"] == "apache-2.0" and info["name"] == "smollm2"  # from the GGUF file
    assert sorted(p.name for p in packed.iterdir()) == [
        "keys", "kunlun-offline.tar", "model.kunlunpkg"]  # fmt: skip


def air_gapped(work: Path, stage: str) -> dict[str, Any]:
    """The findings of ``airgap.py``'s ``stage`` in a network namespace of its own, where
    nothing but loopback is reachable (checked)."""
    python = str(Path(sys.base_prefix) / "bin" / "python3")  # the machine's, not this venv
    inside = f"ip link set lo up && exec {python} {AIRGAP} {work} {free_port()} {stage}"
    done = subprocess.run([*namespace_command(), "sh", "-c", inside], capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["internet"] != "connected" and found["interfaces"] == ["lo"]
    return found


def test_the_bundle_installs_with_no_network(packed: Path) -> None:
    found = air_gapped(packed, "install")
    print("install seconds", found["install"].get("seconds"))
    assert found["install"]["rc"] == 0, found["install"]
    out = found["install"]["out"]
    assert "signature by SHA256:" in out and "(pip --no-index)" in out
    assert f"ExecStart={packed}/prefix/bin/kunlun-platform" in found["unit"]
    assert "--require-signed" in found["unit"]


def test_the_installed_installer_installs_the_package_with_no_network(packed: Path) -> None:
    """A later package needs only the installed command (docs/offline.md)."""
    assert (packed / "prefix" / "bin" / "kunlun-installer").exists(), "not installed"
    found = air_gapped(packed, "package")
    assert found["package"]["rc"] == 0, found["package"]
    assert "installed smollm2 version" in found["package"]["out"], found["package"]
    assert found["list"]["rc"] == 0 and "smollm2" in found["list"]["out"], found["list"]


def test_the_installed_platform_serves_the_package_signed_only_with_no_network(
    packed: Path,
) -> None:
    """After the install above (same folder), in a namespace of its own."""
    assert (packed / "prefix" / "bin" / "kunlun-platform").exists(), "not installed"
    found = air_gapped(packed, "serve")
    print("first answer after seconds", found.get("chat", {}).get("seconds"))
    assert found["submit"]["rc"] == 0, found
    assert found["plain"]["rc"] != 0
    assert "is not an installed signed package" in found["plain"]["err"], found["plain"]
    assert found["chat"]["status"] == 200, found
    answer = found["chat"]["answer"]["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    assert "plan_cache: hit" in found["logs"], found["logs"]
    assert "conversion: none" in found["logs"], found["logs"]
    assert 'kunlun_integrity_ok{kind="package",name="smollm2"} 1.0' in found["metrics"]
    assert 'kunlun_integrity_ok{kind="platform",name="kunlun-platform"} 1.0' in found["metrics"]
    events = [e["event"] for e in found["audit"]]
    assert "started" in events and "verified" in events and "refused" in events
