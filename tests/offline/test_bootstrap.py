"""The offline bundle's installer before anything is installed: standard library only, and it
refuses a bundle that is not exactly what its trusted key signed, leaving nothing behind."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from kunlun.errors import ConfigError, PackageError, SignatureError
from kunlun.offline.archive import write_archive
from kunlun.offline.bootstrap import install_bundle, systemd_unit
from kunlun.offline.bundle import build_installer
from kunlun.offline.manifest import BUNDLE_FORMAT, FileEntry, Manifest, dump
from kunlun.offline.signing import fingerprint, load_private_key, sign

ROOT = Path(__file__).parents[2]


def fake_bundle(tmp_path: Path, key: Path, wheel: bytes = b"PK fake wheel") -> Path:
    source = tmp_path / "demo-1.0-py3-none-any.whl"
    source.write_bytes(wheel)
    private = load_private_key(key)
    entry = FileEntry("wheels/" + source.name, len(wheel), hashlib.sha256(wheel).hexdigest())
    manifest = Manifest(BUNDLE_FORMAT, "kunlun-platform", 1, "2026-12-01T00:00:00Z", "0.1.0",
                        fingerprint(private.public_key()), [entry], {"bundle": {}})  # fmt: skip
    data = dump(manifest)
    out = tmp_path / "bundle.tar"
    write_archive(out, data, sign(private, data), [(entry, source)], 0)
    return out


def test_the_installer_zipapp_runs_on_the_standard_library_alone(tmp_path: Path) -> None:
    pyz = build_installer(tmp_path / "kunlun-installer.pyz")
    done = subprocess.run([sys.executable, "-S", "-I", str(pyz), "--help"], capture_output=True,
                          text=True, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "install" in done.stdout and "--repair" in done.stdout
    assert pyz.read_bytes() == build_installer(tmp_path / "again.pyz").read_bytes()


def test_a_bundle_signed_by_another_key_installs_nothing(
    keys: Path, other_keys: Path, tmp_path: Path
) -> None:
    bundle = fake_bundle(tmp_path, other_keys / "kunlun-signing.key")
    prefix = tmp_path / "prefix"
    with pytest.raises(SignatureError, match="does not verify with the public key"):
        install_bundle(bundle, [keys / "kunlun-signing.pub"], prefix, tmp_path / "home")
    assert not prefix.exists() and not (tmp_path / "home").exists()


def test_a_changed_wheel_installs_nothing(keys: Path, tmp_path: Path) -> None:
    bundle = fake_bundle(tmp_path, keys / "kunlun-signing.key")
    data = bytearray(bundle.read_bytes())
    at = data.index(b"PK fake wheel")
    data[at + 3] ^= 0x20
    bundle.write_bytes(bytes(data))
    prefix = tmp_path / "prefix"
    with pytest.raises(PackageError, match="'wheels/demo-1.0-py3-none-any.whl' does not match"):
        install_bundle(bundle, [keys / "kunlun-signing.pub"], prefix, tmp_path / "home")
    assert not prefix.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".kunlun")] == []


def test_a_prefix_in_use_is_refused(keys: Path, tmp_path: Path) -> None:
    bundle = fake_bundle(tmp_path, keys / "kunlun-signing.key")
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    (prefix / "keep").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        install_bundle(bundle, [keys / "kunlun-signing.pub"], prefix, tmp_path / "home")
    assert (prefix / "keep").read_text() == "mine"


def test_a_wheel_pip_cannot_install_removes_the_prefix(keys: Path, tmp_path: Path) -> None:
    bundle = fake_bundle(tmp_path, keys / "kunlun-signing.key")
    prefix = tmp_path / "prefix"
    with pytest.raises(PackageError, match="pip install --no-index"):
        install_bundle(bundle, [keys / "kunlun-signing.pub"], prefix, tmp_path / "home",
                       say=lambda _line: None)  # fmt: skip
    assert not prefix.exists()


def test_the_shipped_systemd_unit_is_the_installer_s() -> None:
    shipped = (ROOT / "deploy" / "kunlun-platform.service").read_text()
    assert shipped == systemd_unit(Path("/opt/kunlun"), Path("/var/lib/kunlun"), "kunlun")
