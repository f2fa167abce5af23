"""Installing model packages into ``KUNLUN_HOME`` (``kunlun-installer install --package``).

A package is verified and unpacked in one pass: its signature first (trusted keys), then the
:class:`~kunlun.offline.archive.Limits` from the signed sizes, then the version (never older
than the highest installed: rollback protection, remembered in
``KUNLUN_HOME/packages/installed.json`` across restarts), then every member streamed into a
staging directory while it is hashed. Only a package that passed all of it is renamed into
``KUNLUN_HOME/packages/<name>/<version>/``; any failure removes the staging directory, so
nothing is ever half-installed. Installed files are read-only (0444, directories 0555; the
home itself stays 0700) with the package's creation time as their modification time.

The install then registers the model alias (``source`` ``package:<name>@<version>``) and
seeds the plan cache with the package's plan for the device profile it was planned against,
so the first start on that device is a plan-cache hit with no weight conversion.

:func:`repair` re-verifies every installed package against its signed manifest and restores
damaged or missing files (and removes extra ones) from the package file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from kunlun.errors import Location, PackageError
from kunlun.offline.archive import ArchiveError, Limits, hash_file, refused
from kunlun.offline.manifest import (
    MANIFEST,
    SIGNATURE,
    FileEntry,
    Manifest,
    ManifestError,
    created_epoch,
    parse,
)
from kunlun.offline.package import (
    MODEL_DIR,
    PLAN_FILE,
    PROFILE_FILE,
    open_package,
    read_manifest,
)
from kunlun.offline.signing import TrustedKeys
from kunlun.paths import READ_ONLY_DIR

REQUIRED_MEMBERS = (f"{MODEL_DIR}/config.json", PLAN_FILE, PROFILE_FILE)
"""What a model package must hold besides its weights."""
PACKAGES_DIR = READ_ONLY_DIR
REGISTRY_FILE = "installed.json"
FILE_MODE_RO = 0o444
DIR_MODE_RO = 0o555


@dataclass
class InstalledPackage:
    name: str
    version: int
    path: str
    """The install directory (``packages/<name>/<version>``)."""
    package_file: str | None
    signer: str
    manifest_sha256: str
    installed_at: float

    @property
    def model_dir(self) -> Path:
        return Path(self.path) / MODEL_DIR


@dataclass
class Registry:
    """``packages/installed.json``: each model's installed package and highest version."""

    root: Path
    highest: dict[str, int] = field(default_factory=dict)
    active: dict[str, InstalledPackage] = field(default_factory=dict)

    @classmethod
    def load(cls, home: Path) -> Registry:
        root = home / PACKAGES_DIR
        path = root / REGISTRY_FILE
        if not path.is_file():
            return cls(root)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            return cls(
                root,
                {k: int(v) for k, v in raw["highest"].items()},
                {k: InstalledPackage(**v) for k, v in raw["active"].items()},
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise PackageError(
                f"the installed-package registry is unreadable ({exc}); it holds the rollback "
                "protection, so nothing is installed until it is fixed",
                location=Location(str(path)),
            ) from None

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        data = {
            "highest": dict(sorted(self.highest.items())),
            "active": {k: asdict(v) for k, v in sorted(self.active.items())},
        }
        path = self.root / REGISTRY_FILE
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(temporary, path)


def _make_read_only(folder: Path, mtime: float) -> None:
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            os.utime(path, (mtime, mtime))
            os.chmod(path, FILE_MODE_RO)
        for name in dirs:
            os.chmod(os.path.join(root, name), DIR_MODE_RO)
    os.chmod(folder, DIR_MODE_RO)


def _make_writable(folder: Path) -> None:
    """Let the owner change (or remove) an installed tree again."""
    if not folder.exists():
        return
    os.chmod(folder, 0o700)
    for root, dirs, _files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o700)


def remove_tree(folder: Path) -> None:
    _make_writable(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _created_epoch(manifest: Manifest) -> float:
    """The installed files' modification time (``created``, checked by :func:`parse`)."""
    return created_epoch(manifest.created)


class _Writer:
    """Opens each member's file under the staging directory as the archive reaches it."""

    def __init__(self, staging: Path) -> None:
        self.staging = staging
        self.handle: IO[bytes] | None = None

    def __call__(self, entry: FileEntry) -> Callable[[memoryview], object]:
        self.close()
        target = self.staging / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        self.handle = target.open("xb")
        return self.handle.write

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def install_package(
    path: Path,
    trusted: TrustedKeys,
    home: Path,
    store: Any = None,
    limits: Limits | None = None,
) -> tuple[InstalledPackage, str]:
    """Verify and install ``path``; returns the installed package and a line saying what was
    done. ``store`` (a :class:`~kunlun.state.store.StateStore`) gets the model alias."""
    limits = limits or Limits()
    registry = Registry.load(home)
    with open_package(path) as reader:
        manifest, signer = read_manifest(reader, trusted)
        manifest_bytes, signature = reader.manifest_bytes, reader.signature
        where = Location(str(path))
        try:
            limits.check(manifest, reader.size)
        except ArchiveError as exc:
            raise refused(exc, path) from None
        missing = [m for m in REQUIRED_MEMBERS if m not in manifest.by_path()]
        if missing:
            raise PackageError(
                f"not a model package: the manifest lists no {', '.join(missing)}", location=where
            )
        highest = registry.highest.get(manifest.name, 0)
        current = registry.active.get(manifest.name)
        digest = hashlib.sha256(manifest_bytes).hexdigest()
        if manifest.version < highest:
            raise PackageError(
                f"{manifest.name} version {manifest.version} is older than version {highest}, "
                "which was installed here; older packages are refused (rollback protection)",
                location=where,
            )
        if manifest.version == highest and current is not None:
            if current.manifest_sha256 == digest and Path(current.path).is_dir():
                return current, f"{manifest.name} version {manifest.version} already installed"
            raise PackageError(
                f"{manifest.name} version {manifest.version} is already installed with other "
                "contents; a new package needs a higher version",
                location=where,
            )
        root = registry.root / manifest.name
        new_root = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f".staging-{os.getpid()}-{manifest.version}"
        done = False
        try:
            free = shutil.disk_usage(root).free
            if manifest.total_bytes > free:
                raise PackageError(
                    f"needs {manifest.total_bytes} bytes; {free} are free under {root}",
                    location=where,
                )
            remove_tree(staging)
            staging.mkdir()
            writer = _Writer(staging)
            try:
                for _entry in reader.files(manifest, writer):
                    writer.close()
            except ArchiveError as exc:
                raise refused(exc, path) from None
            finally:
                writer.close()
            (staging / MANIFEST).write_bytes(manifest_bytes)
            (staging / SIGNATURE).write_bytes(signature)
            _make_read_only(staging, _created_epoch(manifest))
            final = root / str(manifest.version)
            remove_tree(final)
            os.replace(staging, final)
            done = True
        finally:
            remove_tree(staging)
            if new_root and not done:  # refused: leave no packages/<name>/ behind either
                remove_tree(root)
    installed = InstalledPackage(
        name=manifest.name,
        version=manifest.version,
        path=str(final),
        package_file=str(path.resolve()),
        signer=signer,
        manifest_sha256=digest,
        installed_at=time.time(),
    )
    registry.highest[manifest.name] = manifest.version
    registry.active[manifest.name] = installed
    registry.save()
    if current is not None and current.path != installed.path:
        remove_tree(Path(current.path))
    if store is not None:
        register(store, installed, home)
    return installed, (
        f"installed {manifest.name} version {manifest.version} ({len(manifest.files)} files, "
        f"{manifest.total_bytes} bytes) into {final}; signed by {signer}"
    )


def register(store: Any, installed: InstalledPackage, home: Path) -> None:
    """Register the model alias of ``installed`` and seed the plan cache with its plan."""
    from kunlun.planner.cache import PlanCache
    from kunlun.planner.plan import ExecutionPlan
    from kunlun.state.store import ModelRecord

    base = Path(installed.path)
    store.put_model(
        ModelRecord(
            alias=installed.name,
            path=str(installed.model_dir),
            source=f"package:{installed.name}@{installed.version}",
            created=installed.installed_at,
            meta={"package": asdict(installed)},
        )
    )
    plan = ExecutionPlan.from_dict(json.loads((base / PLAN_FILE).read_text(encoding="utf-8")))
    plan.model_path = str(installed.model_dir)
    profile = json.loads((base / PROFILE_FILE).read_text(encoding="utf-8"))
    PlanCache(home).seed(plan, installed.model_dir, profile["snapshot"])


@dataclass
class Damage:
    path: str
    problem: str


def check_installed(installed: InstalledPackage, trusted: TrustedKeys | None) -> list[Damage]:
    """Every way the installed files differ from the signed manifest (empty: intact). With
    ``trusted``, the installed manifest's signature is checked first."""
    base = Path(installed.path)
    try:
        data = (base / MANIFEST).read_bytes()
        signature = (base / SIGNATURE).read_bytes()
    except OSError as exc:
        return [Damage(MANIFEST, f"unreadable: {exc.strerror}")]
    if hashlib.sha256(data).hexdigest() != installed.manifest_sha256:
        return [Damage(MANIFEST, "differs from the manifest that was installed")]
    if trusted is not None:
        trusted.verify(data, signature, str(base / MANIFEST))
    try:
        manifest = parse(data, str(base / MANIFEST))
    except ManifestError as exc:  # installed before a rule it breaks: repair refuses it
        return [Damage(MANIFEST, f"cannot be used: {exc}")]
    damage: list[Damage] = []
    listed = manifest.by_path()
    for entry in manifest.files:
        target = base / entry.path
        try:
            info = target.lstat()
        except FileNotFoundError:
            damage.append(Damage(entry.path, "missing"))
            continue
        if not stat.S_ISREG(info.st_mode):
            damage.append(Damage(entry.path, "not a regular file"))
            continue
        size, digest = hash_file(target)
        if size != entry.size or digest != entry.sha256:
            damage.append(Damage(entry.path, "content differs from its SHA-256"))
    for root, _dirs, files in os.walk(base):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), base).replace(os.sep, "/")
            if rel not in listed and rel not in (MANIFEST, SIGNATURE):
                damage.append(Damage(rel, "extra file, not in the manifest"))
    return damage


def repair(
    home: Path, trusted: TrustedKeys, packages: dict[str, Path] | None = None
) -> list[dict[str, Any]]:
    """Re-verify every installed package; restore damaged or missing files from its package
    file (``packages`` overrides where a model's package file is) and remove extra ones."""
    registry = Registry.load(home)
    results = []
    for name, installed in sorted(registry.active.items()):
        damage = check_installed(installed, trusted)
        result: dict[str, Any] = {"name": name, "version": installed.version,
                                  "damaged": [asdict(d) for d in damage], "restored": []}  # fmt: skip
        if damage:
            source = (packages or {}).get(name) or (
                Path(installed.package_file) if installed.package_file else None
            )
            if source is None or not source.is_file():
                result["error"] = (
                    f"cannot restore: package file {source} is gone; give it with --package"
                )
            else:
                result["restored"] = _restore(installed, damage, source, trusted)
                left = check_installed(installed, trusted)
                if left:
                    result["error"] = f"still damaged: {', '.join(d.path for d in left)}"
        results.append(result)
    return results


def _restore(
    installed: InstalledPackage, damage: list[Damage], source: Path, trusted: TrustedKeys
) -> list[str]:
    base = Path(installed.path)
    wanted = {d.path for d in damage}
    with open_package(source) as reader:
        manifest, _ = read_manifest(reader, trusted)
        if hashlib.sha256(reader.manifest_bytes).hexdigest() != installed.manifest_sha256:
            raise PackageError(
                f"{source} is not the package installed as {installed.name} version "
                f"{installed.version}",
                location=Location(str(source)),
            )
        _make_writable(base)
        restored: list[str] = []
        try:
            listed = manifest.by_path()
            for rel in wanted - set(listed):  # extra files
                (base / rel).unlink(missing_ok=True)
                restored.append(rel)
            staging = base / f".restore-{os.getpid()}"
            staging.mkdir(exist_ok=True)
            writer = _Writer(staging)

            def sink(entry: FileEntry) -> Callable[[memoryview], object]:
                if entry.path in wanted:
                    return writer(entry)
                writer.close()
                return lambda _chunk: None

            try:
                for entry in reader.files(manifest, sink):
                    writer.close()
                    if entry.path in wanted:
                        target = base / entry.path
                        target.parent.mkdir(parents=True, exist_ok=True)
                        if target.is_dir() and not target.is_symlink():
                            shutil.rmtree(target)
                        os.replace(staging / entry.path, target)
                        restored.append(entry.path)
            except ArchiveError as exc:
                raise refused(exc, source) from None
            finally:
                writer.close()
                shutil.rmtree(staging, ignore_errors=True)
        finally:
            _make_read_only(base, _created_epoch(manifest))
    return sorted(restored)
