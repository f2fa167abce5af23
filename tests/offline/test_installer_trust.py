"""What ``kunlun-installer`` trusts, and what ``--repair`` calls intact (issue 32, the
installer's weak points), through the real commands:

1. a key given with ``--public-key`` is trusted for that command only; a key is trusted for
   good only explicitly (``--trust-key``, ``trust add``, the bundle install: its verifying
   key) or as the first key of a home that trusts none, and each is said and audited;
2. a model's signer is pinned at its first install: a package of it signed by another
   trusted key is refused (exit 3, both fingerprints) unless ``--allow-signer-change``,
   which is recorded in ``installed.json`` and the audit log;
3. ``--repair`` reports (and removes) every file, directory and link the signed manifest
   does not list, never following a link, and a directory replaced by a link to a copy;
4. a name/directory clash is named as one, not as a truncated or damaged package.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
from tests.offline.conftest import MODEL_FILES, PackFn, member, raw_package, run, signed_manifest

from kunlun.offline.archive import ArchiveError, write_archive
from kunlun.offline.bundle import build_installer
from kunlun.offline.install import _Writer
from kunlun.offline.manifest import BUNDLE_FORMAT, FileEntry, Manifest, dump
from kunlun.offline.registry import Registry
from kunlun.offline.signing import fingerprint, load_private_key, load_public_key, sign


def fp(keys: Path) -> str:
    return fingerprint(load_public_key(keys / "kunlun-signing.pub"))


def installer(home: Path, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return run("kunlun-installer", *args, home=home, check=check)


def install(home: Path, package: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return installer(home, "install", "--home", str(home), "--package", str(package), *options)


def pub(keys: Path) -> str:
    return str(keys / "kunlun-signing.pub")


def trusted_list(home: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(
        installer(home, "trust", "list", "--home", str(home), check=True).stdout
    )
    return rows


def audit(home: Path) -> list[dict[str, Any]]:
    path = home / "logs" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def resign(package: Path, key: Path, out: Path, **changes: object) -> Path:
    """``package``'s files under a manifest changed by ``changes`` (a later ``version``,
    another ``name``) and signed by ``key``: what another signer, or a later release, makes."""
    with tarfile.open(package) as tar:
        infos = tar.getmembers()
        raw = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        files = [(i, tar.extractfile(i).read()) for i in infos[2:]]  # type: ignore[union-attr]
    private = load_private_key(key)
    raw.update(changes, signer=fingerprint(private.public_key()))
    data = (json.dumps(raw, indent=2, sort_keys=True) + "\n").encode()
    return raw_package(out, data, sign(private, data), files)


# ---- 1. a --public-key is for one command; trust is explicit ------------------------------


def test_a_public_key_is_trusted_for_one_command_unless_the_operator_trusts_it(
    pack_tiny: PackFn, keys: Path, other_keys: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    mine, theirs = fp(keys), fp(other_keys)
    # the first install into a home that trusts no key: its key becomes the home's, said so
    first = install(home, pack_tiny(), "--public-key", pub(keys))
    assert first.returncode == 0, first.stderr
    assert f"trusted key {mine} (it verified the first install into this home)" in first.stdout
    assert [(r["fingerprint"], r["models"]) for r in trusted_list(home)] == [(mine, ["tiny"])]
    # another key given with --public-key: used for this command, not remembered
    other1 = resign(pack_tiny(), other_keys / "kunlun-signing.key", tmp_path / "o1.kunlunpkg",
                    name="other")  # fmt: skip
    done = install(home, other1, "--public-key", pub(other_keys))
    assert done.returncode == 0, done.stderr
    assert f"note: {theirs}, which signed other, is trusted for this command only" in done.stdout
    assert [r["fingerprint"] for r in trusted_list(home)] == [mine]
    listed = {r["name"]: r for r in json.loads(installer(home, "list", "--home", str(home)).stdout)}
    assert listed["other"]["signer_trusted"] is False and listed["tiny"]["signer_trusted"] is True
    # ... so the next command does not trust it (before: it was copied into trusted-keys)
    other2 = resign(pack_tiny(), other_keys / "kunlun-signing.key", tmp_path / "o2.kunlunpkg",
                    name="other", version=2)  # fmt: skip
    done = install(home, other2)
    assert done.returncode == 3 and "does not verify with any trusted key" in done.stderr
    # --trust-key: used and recorded, said and audited
    done = install(home, other2, "--trust-key", pub(other_keys))
    assert done.returncode == 0, done.stderr
    assert f"trusted key {theirs} (--trust-key): recorded in {home}/trusted-keys/" in done.stdout
    assert {r["fingerprint"] for r in trusted_list(home)} == {mine, theirs}
    # trust remove (by fingerprint prefix) / trust add (by file)
    done = installer(home, "trust", "remove", theirs[:23], "--home", str(home))
    assert done.returncode == 0, done.stderr
    assert f"removed trusted key {theirs}" in done.stdout
    assert "models pinned to it: other" in done.stdout
    assert [r["fingerprint"] for r in trusted_list(home)] == [mine]
    done = installer(home, "trust", "add", pub(other_keys), "--home", str(home), check=True)
    assert f"trusted key {theirs} (trust add)" in done.stdout
    again = installer(home, "trust", "add", pub(other_keys), "--home", str(home), check=True)
    assert f"key {theirs} is trusted already" in again.stdout
    bad = installer(home, "trust", "remove", "SHA256:abc", "--home", str(home))
    assert bad.returncode == 2 and "at least 16 hex digits" in bad.stderr
    events = [(e["event"], e["fingerprint"], e.get("reason")) for e in audit(home)]
    assert events == [
        ("key_trusted", mine, "it verified the first install into this home"),
        ("key_trusted", theirs, "--trust-key"),
        ("key_untrusted", theirs, None),
        ("key_trusted", theirs, "trust add"),
    ]


def fake_platform_wheel() -> tuple[str, bytes]:
    """A wheel named ``kunlun-platform`` with an ``engine`` extra and nothing in it: what
    ``pip install --no-index kunlun-platform[engine]`` installs in a second."""
    name, info = "kunlun_platform-0.0.1-py3-none-any.whl", "kunlun_platform-0.0.1.dist-info"
    files = {
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: kunlun-platform\nVersion: 0.0.1\n"
        b"Provides-Extra: engine\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = ""
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(data)}\n"
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
    return name, buffer.getvalue()


def test_the_bundle_install_records_only_the_key_that_verified_the_bundle(
    keys: Path, other_keys: Path, tmp_path: Path
) -> None:
    name, wheel = fake_platform_wheel()
    source = tmp_path / name
    source.write_bytes(wheel)
    private = load_private_key(keys / "kunlun-signing.key")
    entry = FileEntry(f"wheels/{name}", len(wheel), hashlib.sha256(wheel).hexdigest())
    manifest = dump(Manifest(BUNDLE_FORMAT, "kunlun-platform", 1, "2026-12-01T00:00:00Z",
                             "0.1.0", fp(keys), [entry], {"bundle": {}}))  # fmt: skip
    bundle = tmp_path / "kunlun-offline.tar"
    write_archive(bundle, manifest, sign(private, manifest), [(entry, source)], 0)
    pyz = build_installer(tmp_path / "kunlun-installer.pyz")
    home = tmp_path / "home"

    def pyz_run(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "KUNLUN_HOME"}
        return subprocess.run([sys.executable, "-S", "-I", str(pyz), *args], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=600)  # fmt: skip

    done = pyz_run("install", "--bundle", str(bundle), "--public-key", pub(other_keys),
                   "--public-key", pub(keys), "--prefix", str(tmp_path / "prefix"),
                   "--home", str(home))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"trusted key {fp(keys)} (it verified the bundle): recorded in {home}/trusted-keys/" in (
        done.stdout
    )
    assert fp(other_keys) not in done.stdout  # given, but it did not sign the bundle
    listed = pyz_run("trust", "list", "--home", str(home))  # standard library alone
    assert listed.returncode == 0, listed.stderr
    assert [r["fingerprint"] for r in json.loads(listed.stdout)] == [fp(keys)]
    assert [(e["event"], e["reason"]) for e in audit(home)] == [
        ("key_trusted", "it verified the bundle")
    ]


# ---- 2. a model's signer is pinned -------------------------------------------------------


def test_a_model_s_signer_is_pinned_and_a_change_needs_the_operator_s_flag(
    pack_tiny: PackFn, keys: Path, other_keys: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    mine, theirs = fp(keys), fp(other_keys)
    done = install(home, pack_tiny(), "--public-key", pub(keys))
    assert done.returncode == 0 and "(its signer is pinned now)" in done.stdout, done.stderr
    installer(home, "trust", "add", pub(other_keys), "--home", str(home), check=True)
    theirs2 = resign(pack_tiny(), other_keys / "kunlun-signing.key", tmp_path / "t2.kunlunpkg",
                     version=2)  # fmt: skip
    refused = install(home, theirs2)  # both keys trusted: the pin refuses it
    assert refused.returncode == 3, refused.stdout + refused.stderr
    line = refused.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert f"tiny is pinned to signer {mine}, the key it was first installed with" in line
    assert f"this package (version 2) is signed by {theirs}" in line
    assert "--allow-signer-change" in line
    registry = Registry.load(home)
    assert registry.active["tiny"].version == 1 and registry.signers == {"tiny": mine}
    assert sorted(p.name for p in (home / "packages" / "tiny").iterdir()) == ["1"]
    # the operator's explicit flag: installed, and the change said, recorded and audited
    done = install(home, theirs2, "--allow-signer-change")
    assert done.returncode == 0, done.stderr
    assert f"signer of tiny changed from {mine} to {theirs} (--allow-signer-change)" in done.stdout
    registry = Registry.load(home)
    assert registry.active["tiny"].version == 2 and registry.signers == {"tiny": theirs}
    change = registry.signer_changes[0]
    assert (change["name"], change["version"], change["from"], change["to"]) == (
        "tiny", 2, mine, theirs)  # fmt: skip
    event = next(e for e in audit(home) if e["event"] == "signer_changed")
    assert (event["previous_signer"], event["signer"], event["version"]) == (mine, theirs, 2)
    # pinned to the new signer now: the old key's next version is refused the same way
    mine3 = resign(pack_tiny(), keys / "kunlun-signing.key", tmp_path / "m3.kunlunpkg", version=3)
    done = install(home, mine3)
    assert done.returncode == 3 and f"tiny is pinned to signer {theirs}" in done.stderr
    theirs3 = resign(pack_tiny(), other_keys / "kunlun-signing.key", tmp_path / "t3.kunlunpkg",
                     version=3)  # fmt: skip
    assert install(home, theirs3).returncode == 0


# ---- 3. --repair: what the manifest does not list is damage ------------------------------


def writable(*folders: Path) -> None:
    for folder in folders:
        os.chmod(folder, 0o755)


def repair(home: Path) -> subprocess.CompletedProcess[str]:
    return installer(home, "--repair", "--home", str(home))


def test_repair_reports_extra_directories_links_and_fifos_and_never_follows_a_link(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    assert install(home, pack_tiny(), "--public-key", pub(keys)).returncode == 0
    base = home / "packages" / "tiny" / "1"
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    (outside / "secret").write_text("mine")
    os.chmod(outside / "secret", 0o600)
    writable(base / "model", base / "plan")
    (base / "model" / "empty").mkdir()  # was "intact"
    (base / "model" / "stash").mkdir()
    (base / "model" / "stash" / "a.py").write_text("x")
    (base / "model" / "elsewhere").symlink_to(outside, target_is_directory=True)  # was intact
    (base / "plan" / "alias.json").symlink_to("../model/config.json")
    os.mkfifo(base / "model" / "pipe")
    done = repair(home)
    assert done.returncode == 0, done.stdout + done.stderr
    for text in (
        "model/empty (extra directory, not in the manifest)",
        "model/stash (extra directory holding 1 entries, not in the manifest)",
        f"model/elsewhere (extra symbolic link to '{outside}', which points outside the "
        "package, not in the manifest)",
        "plan/alias.json (extra symbolic link to '../model/config.json', not in the manifest)",
        "model/pipe (extra FIFO, not in the manifest)",
        "restored 5 file(s)",
    ):
        assert text in done.stdout, done.stdout
    # what the links pointed to is untouched: not removed, not made read-only
    assert (outside / "secret").read_text() == "mine"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o700
    assert stat.S_IMODE((outside / "secret").stat().st_mode) == 0o600
    assert "tiny version 1: intact" in repair(home).stdout
    assert stat.S_IMODE((base / "model").stat().st_mode) == 0o555


def test_repair_finds_a_directory_swapped_for_a_link_to_a_copy(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    """Every file hashes right through the link (before: intact), but the files served are
    outside the package, where anyone who can write there changes them."""
    home = tmp_path / "home"
    assert install(home, pack_tiny(), "--public-key", pub(keys)).returncode == 0
    base = home / "packages" / "tiny" / "1"
    copy = tmp_path / "copy"
    shutil.copytree(base / "plan", copy)
    writable(base, base / "plan")
    shutil.rmtree(base / "plan")
    (base / "plan").symlink_to(copy, target_is_directory=True)
    done = repair(home)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (f"plan (a symbolic link to '{copy}', which points outside the package, where the "
            "manifest expects a directory)") in done.stdout  # fmt: skip
    assert "plan/plan.json (missing ('plan' is not a directory))" in done.stdout
    assert (base / "plan").is_dir() and not (base / "plan").is_symlink()
    restored = sorted(p.name for p in (base / "plan").iterdir())
    assert sorted(p.name for p in copy.iterdir()) == restored  # the copy is left alone
    assert "tiny version 1: intact" in repair(home).stdout


# ---- 4. a name/directory clash is named --------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("plan/plan.json/x", "files[3].path 'plan/plan.json' is listed as a file, and "
         "'plan/plan.json/x' needs it to be a directory (a name/directory clash)"),
        ("manifest.json/x", "'manifest.json/x' needs 'manifest.json' to be a directory, but it "
         "is the archive's own file (a name/directory clash)"),
    ],
)  # fmt: skip
def test_a_name_directory_clash_is_named_not_called_truncated(
    keys: Path, tmp_path: Path, extra: str, expected: str
) -> None:
    files = {**MODEL_FILES, extra: b"x"}
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", files)
    package = raw_package(tmp_path / "p.kunlunpkg", manifest, sig,
                          [member(p, d) for p, d in sorted(files.items())])  # fmt: skip
    home = tmp_path / "home"
    for args in (("kunlun-installer", "install", "--home", str(home), "--package", str(package),
                  "--public-key", pub(keys)),
                 ("kunlun-cli", "model", "verify", "--package", str(package), "--public-key",
                  pub(keys))):  # fmt: skip
        done = run(*args, home=home, check=False)
        assert done.returncode == 3, done.stdout + done.stderr
        assert expected in done.stderr and "truncated" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (home / "packages").exists() or not any((home / "packages").iterdir())


def test_repair_names_a_file_where_a_directory_belongs(
    pack_tiny: PackFn, keys: Path, tmp_path: Path
) -> None:
    """Before: ``lstat`` of ``plan/plan.json`` under a file ``plan`` raised NotADirectoryError
    out of --repair."""
    home = tmp_path / "home"
    assert install(home, pack_tiny(), "--public-key", pub(keys)).returncode == 0
    base = home / "packages" / "tiny" / "1"
    writable(base, base / "plan")
    shutil.rmtree(base / "plan")
    (base / "plan").write_text("not a directory")
    done = repair(home)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert "plan (a file, where the manifest expects a directory)" in done.stdout
    assert "plan/plan.json (missing ('plan' is not a directory))" in done.stdout
    assert "tiny version 1: intact" in repair(home).stdout


def test_the_unpacker_names_a_clash_it_meets(tmp_path: Path) -> None:
    """The unpacking writer's own check, behind the manifest's (which refuses such a list
    before anything is unpacked): whatever is in the way is named, not read as truncation."""
    writer = _Writer(tmp_path)
    (tmp_path / "a").write_text("file")
    (tmp_path / "d").mkdir()
    with pytest.raises(ArchiveError, match="'a/b' needs 'a' to be a directory, but a file"):
        writer(FileEntry("a/b", 0, "0" * 64))
    with pytest.raises(ArchiveError, match="'d' is a file, but a directory of that name"):
        writer(FileEntry("d", 0, "0" * 64))
