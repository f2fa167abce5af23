"""``kunlun-installer install --package`` and ``--repair``: a good package installs read-only
and registered; each bad input is refused naming its cause, leaving nothing behind."""

from __future__ import annotations

import gzip
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest
from tests.offline.conftest import (
    MODEL_FILES,
    PackFn,
    member,
    raw_package,
    run,
    signed_manifest,
)

from kunlun.offline.archive import Limits
from kunlun.offline.install import install_package
from kunlun.offline.registry import Registry
from kunlun.offline.signing import TrustedKeys


def install(home: Path, package: Path, keys: Path, check: bool = False):  # type: ignore[no-untyped-def]
    return run("kunlun-installer", "install", "--home", str(home), "--package", str(package),
               "--public-key", str(keys / "kunlun-signing.pub"), home=home, check=check)  # fmt: skip


def assert_nothing_installed(home: Path, name: str = "tiny") -> None:
    """No registry entry, no install directory, no staging, not even an empty
    ``packages/<name>/`` left for ``name``."""
    registry = Registry.load(home)
    assert name not in registry.active
    folder = home / "packages" / name
    assert not folder.exists(), list(folder.iterdir())


def refused(home: Path, package: Path, keys: Path, *expected: str) -> str:
    done = install(home, package, keys)
    assert done.returncode == 3, done.stdout + done.stderr
    for text in expected:
        assert text in done.stderr, done.stderr
    assert_nothing_installed(home)
    return done.stderr


def test_a_package_installs_read_only_registered_and_with_its_plan_cached(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    done = install(home, pack_tiny(), keys, check=True)
    assert "installed tiny version 1" in done.stdout
    target = home / "packages" / "tiny" / "1"
    assert stat.S_IMODE(target.stat().st_mode) == 0o555
    for path in target.rglob("*"):
        want = 0o555 if path.is_dir() else 0o444
        assert stat.S_IMODE(path.stat().st_mode) == want, path
    listed = json.loads(run("kunlun-cli", "model", "list", "--json", home=home).stdout)
    entry = next(m for m in listed if m["alias"] == "tiny")
    assert entry["source"] == "package:tiny@1" and entry["path"] == str(target / "model")
    assert len(list((home / "plan-cache").iterdir())) == 1  # seeded with the package's plan
    assert (home / "trusted-keys").is_dir()
    again = install(home, pack_tiny(), keys, check=True)  # the same package: nothing to do
    assert "already installed" in again.stdout
    for args in (("list", "--home", str(home)), ("--home", str(home), "list")):  # either place
        listed_here = run("kunlun-installer", *args, home=tmp_path / "elsewhere", check=True)
        assert "tiny" in listed_here.stdout and "1" in listed_here.stdout, listed_here.stdout


def test_a_flipped_bit_in_any_file_is_refused(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    package = pack_tiny()
    with tarfile.open(package) as tar:
        names = [m for m in tar.getmembers() if m.name not in ("manifest.json", "manifest.sig")]
    data = package.read_bytes()
    for i, info in enumerate(names):
        bad = bytearray(data)
        bad[info.offset_data + info.size // 2] ^= 0x10
        path = tmp_path / f"bad{i}.kunlunpkg"
        path.write_bytes(bytes(bad))
        refused(tmp_path / f"home{i}", path, keys, f"{info.name!r} does not match its SHA-256")


def test_an_extra_file_is_refused(keys: Path, tmp_path: Path) -> None:
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", MODEL_FILES)
    members = [member(p, d) for p, d in sorted(MODEL_FILES.items())]
    package = raw_package(tmp_path / "p.kunlunpkg", manifest, sig,
                          [*members, member("model/evil.py", b"import os")])  # fmt: skip
    refused(tmp_path / "home", package, keys, "extra file 'model/evil.py' is not in the signed")


def test_a_missing_file_is_refused(keys: Path, tmp_path: Path) -> None:
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", MODEL_FILES)
    members = [member(p, d) for p, d in sorted(MODEL_FILES.items()) if "safetensors" not in p]
    package = raw_package(tmp_path / "p.kunlunpkg", manifest, sig, members)
    refused(tmp_path / "home", package, keys, "missing, first 'model/model.safetensors'")


def test_a_manifest_signed_by_an_untrusted_key_is_refused(
    keys: Path, other_keys: Path, tmp_path: Path
) -> None:
    manifest, sig = signed_manifest(other_keys / "kunlun-signing.key", MODEL_FILES)
    members = [member(p, d) for p, d in sorted(MODEL_FILES.items())]
    package = raw_package(tmp_path / "p.kunlunpkg", manifest, sig, members)
    stderr = refused(tmp_path / "home", package, keys, "does not verify with any trusted key")
    assert "package.signature" in stderr
    # the same bytes with a manifest edited after signing
    manifest2, _ = signed_manifest(keys / "kunlun-signing.key", {**MODEL_FILES, "x": b""})
    forged = raw_package(tmp_path / "q.kunlunpkg", manifest2, sig, members)
    refused(tmp_path / "home2", forged, keys, "does not verify with any trusted key")


def test_an_older_version_is_refused_also_after_a_restart(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    install(home, pack_tiny(version=4), keys, check=True)
    done = install(home, pack_tiny(version=2), keys)
    assert done.returncode == 3
    assert "version 2 is older than version 4, which was installed here" in done.stderr
    assert Registry.load(home).highest["tiny"] == 4  # remembered on disk
    assert sorted(p.name for p in (home / "packages" / "tiny").iterdir()) == ["4"]
    install(home, pack_tiny(version=6), keys, check=True)  # newer: replaces version 4
    assert sorted(p.name for p in (home / "packages" / "tiny").iterdir()) == ["6"]


@pytest.mark.parametrize("name", ["../x", "/etc/x", "model/../../x"])
def test_a_member_that_climbs_out_is_refused(keys: Path, tmp_path: Path, name: str) -> None:
    files = {**MODEL_FILES, name: b"owned"}
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", MODEL_FILES)
    members = [member(p, d) for p, d in sorted(files.items())]
    package = raw_package(tmp_path / "p.kunlunpkg", manifest, sig, members)
    stderr = refused(tmp_path / "home", package, keys, repr(name))
    assert "absolute path" in stderr or "climbs out" in stderr
    assert not (tmp_path / "x").exists() and not Path("/etc/x").exists()
    # and a signed manifest naming such a path is refused before any member is read
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", files)
    package = raw_package(tmp_path / "q.kunlunpkg", manifest, sig, members)
    refused(tmp_path / "home2", package, keys, repr(name))


def test_a_symlink_that_escapes_is_refused(keys: Path, tmp_path: Path) -> None:
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", MODEL_FILES)
    link = tarfile.TarInfo("model/tokenizer.json")
    link.type, link.linkname = tarfile.SYMTYPE, "../../../../etc/passwd"
    members = [member(p, d) for p, d in sorted(MODEL_FILES.items())]
    package = raw_package(tmp_path / "p.kunlunpkg", manifest, sig, [(link, None), *members])
    refused(tmp_path / "home", package, keys, "is a symbolic link to '../../../../etc/passwd', "
            "which leaves the package directory")  # fmt: skip


def test_device_files_and_setuid_bits_are_refused(keys: Path, tmp_path: Path) -> None:
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", MODEL_FILES)
    members = [member(p, d) for p, d in sorted(MODEL_FILES.items())]
    device = tarfile.TarInfo("model/config.json")
    device.type, device.devmajor, device.devminor = tarfile.CHRTYPE, 1, 3
    package = raw_package(tmp_path / "p.kunlunpkg", manifest, sig, [(device, None), *members])
    refused(tmp_path / "home", package, keys, "is a device or FIFO")
    setuid = [(info, data) for info, data in members]
    setuid[0][0].mode = 0o4755
    package = raw_package(tmp_path / "q.kunlunpkg", manifest, sig, setuid)
    refused(tmp_path / "home2", package, keys, "has setuid, setgid or sticky bits")


def test_a_tar_bomb_is_refused_by_ratio_and_by_size(keys: Path, tmp_path: Path) -> None:
    zeros = b"\x00" * (64 << 20)  # 64 MiB of zeros gzip to about 64 KiB: a ratio near 1000
    files = {**MODEL_FILES, "model/model.safetensors": zeros}
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", files)
    members = [member(p, d) for p, d in sorted(files.items())]
    bomb = raw_package(tmp_path / "bomb.kunlunpkg", manifest, sig, members, mode="w:gz")
    assert bomb.stat().st_size < (1 << 20)
    refused(tmp_path / "home", bomb, keys, "a compression ratio of", "over the limit of 100x")
    # by size: the same package unpacked under a 32 MiB limit (kunlun-installer's is 2 TiB)
    plain = raw_package(tmp_path / "big.kunlunpkg", manifest, sig, members)
    home = tmp_path / "home2"
    trusted = TrustedKeys.from_paths([keys / "kunlun-signing.pub"])
    with pytest.raises(Exception, match="over the limit of 33554432 bytes"):
        install_package(plain, trusted, home, None, Limits(max_total_bytes=32 << 20))
    assert_nothing_installed(home)


def test_too_many_members_are_refused(keys: Path, tmp_path: Path) -> None:
    files = {**MODEL_FILES, **{f"model/f{i}": b"" for i in range(20)}}
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", files)
    package = raw_package(tmp_path / "p.kunlunpkg", manifest, sig,
                          [member(p, d) for p, d in sorted(files.items())])  # fmt: skip
    trusted = TrustedKeys.from_paths([keys / "kunlun-signing.pub"])
    with pytest.raises(Exception, match="24 files, over the limit of 10 members"):
        install_package(package, trusted, tmp_path / "home", None, Limits(max_members=10))


@pytest.mark.parametrize("cut", [0.3, 0.999])
def test_a_truncated_package_is_refused(
    pack_tiny: PackFn, keys: Path, tmp_path: Path, cut: float
) -> None:
    data = pack_tiny().read_bytes()
    package = tmp_path / "cut.kunlunpkg"
    # at least 16 KiB short: a tar ends in up to 10 KiB of zero padding, whose loss is no harm
    package.write_bytes(data[: min(int(len(data) * cut), len(data) - 16384)])
    stderr = refused(tmp_path / "home", package, keys)
    assert "truncated" in stderr, stderr


def test_a_manifest_that_is_not_json_is_refused(keys: Path, tmp_path: Path) -> None:
    from kunlun.offline.signing import load_private_key, sign

    manifest = b'{"format": "kunlunpkg/1", "files": [\n  {"path": "x",\n'
    sig = sign(load_private_key(keys / "kunlun-signing.key"), manifest)
    package = raw_package(tmp_path / "p.kunlunpkg", manifest, sig, [member("x", b"")])
    refused(tmp_path / "home", package, keys, "manifest.json is not JSON:", "line 3 column 1")


def test_a_file_that_is_no_package_is_refused(keys: Path, tmp_path: Path) -> None:
    package = tmp_path / "p.kunlunpkg"
    package.write_bytes(gzip.compress(b"hello"))
    refused(tmp_path / "home", package, keys, "not a tar archive")
    package.write_bytes(b"")
    refused(tmp_path / "home", package, keys, "is not a tar archive")


def test_repair_restores_damaged_missing_and_extra_files(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    install(home, pack_tiny(), keys, check=True)
    base = home / "packages" / "tiny" / "1"
    ok = run("kunlun-installer", "--repair", "--home", str(home), home=home)
    assert "tiny version 1: intact" in ok.stdout
    os.chmod(base / "model", 0o755)
    weights = base / "model" / "model.safetensors"
    os.chmod(weights, 0o644)
    with weights.open("r+b") as handle:
        handle.seek(200)
        handle.write(b"\xff\xff")
    (base / "model" / "tokenizer.json").unlink()
    (base / "model" / "backdoor.py").write_text("x")
    fixed = run("kunlun-installer", "--repair", "--home", str(home), home=home)
    assert "restored 3 file(s)" in fixed.stdout, fixed.stdout
    for text in ("model/model.safetensors (content differs", "model/tokenizer.json (missing",
                 "model/backdoor.py (extra file"):  # fmt: skip
        assert text in fixed.stdout
    again = run("kunlun-installer", "--repair", "--home", str(home), home=home)
    assert "tiny version 1: intact" in again.stdout
    assert stat.S_IMODE(weights.stat().st_mode) == 0o444
    assert stat.S_IMODE((base / "model").stat().st_mode) == 0o555
