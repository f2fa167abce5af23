"""The offline bundle (``kunlun-installer bundle``), built on a connected machine.

A bundle is a signed archive (:mod:`.archive`, format :data:`~.manifest.BUNDLE_FORMAT`) of:

- ``wheels/``: the platform's wheel and a wheel of every dependency of
  ``kunlun-platform[engine]`` for the target Python and platform, torch included: the torch
  wheel the operator gives (``--torch-wheel``, the build for the target's chip), else the
  build installed here (on these machines the CPU build);
- ``kunlun-installer.pyz``: the installer (:mod:`.bootstrap`) as a zipapp of standard-library
  code, which verifies the bundle before it installs anything.

Wheels come from ``pip wheel`` for this machine's Python and platform, or, with
``--python-version``/``--platform``, from ``pip download --only-binary=:all:`` for another
target (a dependency published only as source then has to be built on a machine like the
target).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
import zipapp
from importlib import metadata
from pathlib import Path

from kunlun import __version__
from kunlun.errors import ConfigError, Location
from kunlun.offline.archive import hash_file, write_archive
from kunlun.offline.bootstrap import INSTALLER_MEMBER, PLATFORM_REQUIREMENT, WHEELS_DIR, run_step
from kunlun.offline.manifest import BUNDLE_FORMAT, FileEntry, Manifest, dump
from kunlun.offline.package import checked_manifest, created_time, iso_utc
from kunlun.offline.signing import fingerprint, load_private_key, sign

#: The modules the installer zipapp holds: the bootstrap and what it imports, all standard
#: library only (a test imports the zipapp with no site-packages to keep it so).
ZIPAPP_MODULES = (
    "kunlun/__init__.py",
    "kunlun/address.py",
    "kunlun/errors.py",
    "kunlun/offline/__init__.py",
    "kunlun/offline/archive.py",
    "kunlun/offline/audit_log.py",
    "kunlun/offline/bootstrap.py",
    "kunlun/offline/ed25519.py",
    "kunlun/offline/manifest.py",
    "kunlun/offline/trust.py",
    "kunlun/paths.py",
)
_ZIP_TIME = 315532800 + 86400
"""Every zipapp member's time (1980-01-02: zip has no earlier dates), so the zipapp is the same bytes
from the same sources."""
_ZIP_MAIN = "import sys\nfrom kunlun.offline.bootstrap import main\nsys.exit(main())\n"


def source_tree() -> Path:
    """The platform's source tree: where this installation was installed from in editable
    mode (pip's ``direct_url.json``), else the tree this module sits in."""
    try:
        direct = metadata.distribution("kunlun-platform").read_text("direct_url.json")
        if direct:
            url = json.loads(direct).get("url", "")
            if url.startswith("file://") and (Path(url[7:]) / "pyproject.toml").is_file():
                return Path(url[7:])
    except metadata.PackageNotFoundError:
        pass
    here = Path(__file__).resolve().parents[3]
    if (here / "pyproject.toml").is_file():
        return here
    raise ConfigError(
        "cannot find the platform's source tree to build its wheel",
        location=Location("--source"),
        hint="give --source DIR (a checkout of kunlun-platform)",
    )


def build_installer(out: Path) -> Path:
    """``kunlun-installer.pyz``: the bootstrap and its standard-library-only imports."""
    package_root = Path(__file__).resolve().parents[2]  # .../src
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for module in ZIPAPP_MODULES:
            target = root / module
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(package_root / module, target)
            os.utime(target, (_ZIP_TIME, _ZIP_TIME))
        (root / "__main__.py").write_text(_ZIP_MAIN)
        # every entry's time fixed, folders too (zipapp stores them), so that two builds are
        # byte for byte the same however far apart they run
        for path in [root / "__main__.py", *(p for p in root.rglob("*") if p.is_dir())]:
            os.utime(path, (_ZIP_TIME, _ZIP_TIME))
        zipapp.create_archive(root, out, interpreter="/usr/bin/env python3")
    return out


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("$ " + " ".join(cmd), flush=True)
    run_step(cmd, what)


def torch_requirement(torch_wheel: Path | None) -> str:
    """The torch the bundle carries: the operator's wheel, else the version installed here."""
    if torch_wheel is not None:
        if not torch_wheel.is_file() or torch_wheel.suffix != ".whl":
            raise ConfigError("not a wheel file", location=Location(str(torch_wheel)))
        return str(torch_wheel.resolve())
    try:
        return f"torch=={metadata.version('torch')}"
    except metadata.PackageNotFoundError:
        raise ConfigError(
            "torch is not installed here; give the target's build with --torch-wheel",
            location=Location("--torch-wheel"),
        ) from None


def collect_wheels(
    wheels: Path,
    source: Path,
    torch_wheel: Path | None,
    python_version: str | None,
    platform: str | None,
) -> None:
    requirement = f"{source}[{PLATFORM_REQUIREMENT.split('[')[1]}"
    torch = torch_requirement(torch_wheel)
    if python_version or platform:
        _pip(["wheel", "--no-deps", "-q", "-w", str(wheels), str(source)], "building the wheel")
        target = ["--only-binary=:all:"]
        if python_version:
            target += ["--python-version", python_version]
        if platform:
            target += ["--platform", platform]
        _pip(["download", "-q", "-d", str(wheels), *target, requirement, torch],
             "downloading the dependencies' wheels")  # fmt: skip
    else:
        _pip(["wheel", "-q", "-w", str(wheels), requirement, torch], "collecting wheels")


def build_bundle(
    out: Path,
    key_path: Path,
    *,
    torch_wheel: Path | None = None,
    source: Path | None = None,
    python_version: str | None = None,
    platform: str | None = None,
    version: int | None = None,
) -> Manifest:
    key = load_private_key(key_path)
    source = (source or source_tree()).resolve()
    when = created_time()
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".kunlun-bundle-", dir=out.parent) as scratch:
        root = Path(scratch)
        wheels = root / WHEELS_DIR
        wheels.mkdir()
        collect_wheels(wheels, source, torch_wheel, python_version, platform)
        build_installer(root / INSTALLER_MEMBER)
        members = [root / INSTALLER_MEMBER, *sorted(wheels.glob("*.whl"))]
        entries = []
        for path in members:
            size, digest = hash_file(path)
            entries.append((FileEntry(path.relative_to(root).as_posix(), size, digest), path))
        entries.sort(key=lambda e: e[0].path)
        manifest = Manifest(
            format=BUNDLE_FORMAT,
            name="kunlun-platform",
            version=version or when,
            created=iso_utc(when),
            kunlun_version=__version__,
            signer=fingerprint(key.public_key()),
            files=[e for e, _ in entries],
            extra={
                "bundle": {
                    "requirement": PLATFORM_REQUIREMENT,
                    "python": python_version
                    or f"{sys.version_info.major}.{sys.version_info.minor}",
                    "platform": platform or sysconfig.get_platform(),
                    "torch": torch_wheel.name if torch_wheel else torch_requirement(None),
                    "wheels": len(entries) - 1,
                }
            },
        )
        data = checked_manifest(dump(manifest), out, BUNDLE_FORMAT)
        write_archive(out, data, sign(key, data), entries, when)
    print(
        f"bundle {out}: {len(manifest.files) - 1} wheels and the installer, "
        f"{manifest.total_bytes} bytes; signer {manifest.signer}",
        flush=True,
    )
    return manifest
