"""Installing model packages into ``KUNLUN_HOME`` (``kunlun-installer install --package``).

A package is verified and unpacked in one pass: its signature first (trusted keys), then the
:class:`~kunlun.offline.archive.Limits` from the signed sizes, then its signer (pinned per
model at its first install: another key's package is refused unless
``--allow-signer-change``, which is recorded), then the version (never older than the
highest installed: rollback protection, remembered in ``KUNLUN_HOME/packages/installed.json``
across restarts, :mod:`.registry`), then every member streamed into a staging directory
while it is hashed. Only a package that passed all of it is renamed into
``KUNLUN_HOME/packages/<name>/<version>/``; any failure removes the staging directory, so
nothing is ever half-installed. Installed files are read-only (0444, directories 0555; the
home itself stays 0700) with the package's creation time as their modification time.

The install then registers the model alias (``source`` ``package:<name>@<version>``) and
seeds the plan cache with the package's plan for the device profile it was planned against,
so the first start on that device is a plan-cache hit with no weight conversion.

:func:`repair` re-verifies every installed package against its signed manifest
(:func:`~kunlun.offline.damage.check_installed`), restores damaged or missing files from the
package file, and removes anything the manifest does not list: a file, a directory, a
symbolic link (never followed, wherever it points).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from kunlun.errors import Location, PackageError
from kunlun.offline.archive import ArchiveError, ArchiveReader, Limits, refused
from kunlun.offline.audit_log import AUDIT_FILE, audit
from kunlun.offline.damage import Damage, check_installed
from kunlun.offline.manifest import MANIFEST, SIGNATURE, FileEntry, Manifest, created_epoch
from kunlun.offline.package import (
    MODEL_DIR,
    PLAN_FILE,
    PROFILE_FILE,
    open_package,
    read_manifest,
)
from kunlun.offline.registry import REGISTRY_FILE, InstalledPackage, Registry
from kunlun.offline.signing import TrustedKeys
from kunlun.paths import make_writable, remove_tree

REQUIRED_MEMBERS = (f"{MODEL_DIR}/config.json", PLAN_FILE, PROFILE_FILE)
"""What a model package must hold besides its weights."""
FILE_MODE_RO = 0o444
DIR_MODE_RO = 0o555


def _make_read_only(folder: Path, mtime: float) -> None:
    """Files 0444 with ``mtime``, directories 0555. A symbolic link is left alone: chmod and
    utime would change what it points to, maybe outside the package."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            os.utime(path, (mtime, mtime))
            os.chmod(path, FILE_MODE_RO)
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, DIR_MODE_RO)
    os.chmod(folder, DIR_MODE_RO)


def _created_epoch(manifest: Manifest) -> float:
    """The installed files' modification time (``created``, checked by
    :func:`~kunlun.offline.manifest.parse`)."""
    return created_epoch(manifest.created)


class _Writer:
    """Opens each member's file under the staging directory as the archive reaches it."""

    def __init__(self, staging: Path) -> None:
        self.staging = staging
        self.handle: IO[bytes] | None = None

    def __call__(self, entry: FileEntry) -> Callable[[memoryview], object]:
        self.close()
        target = self.staging / entry.path
        parts = entry.path.split("/")
        for i in range(1, len(parts)):  # each folder the member needs: a folder, or a clash
            folder = self.staging.joinpath(*parts[:i])
            if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
                raise ArchiveError(
                    f"member {entry.path!r} needs {'/'.join(parts[:i])!r} to be a directory, "
                    "but a file of that name was unpacked before it (a name/directory clash)"
                )
        if target.is_dir() or target.is_symlink():
            raise ArchiveError(
                f"member {entry.path!r} is a file, but a directory of that name was unpacked "
                "before it (a name/directory clash)"
            )
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
    *,
    allow_signer_change: bool = False,
) -> tuple[InstalledPackage, str]:
    """Verify and install ``path``; returns the installed package and the lines saying what
    was done. ``store`` (a :class:`~kunlun.state.store.StateStore`) gets the model alias.

    The first install of a model pins its signer (the fingerprint of the key that verified
    it); a package of that model signed by another trusted key is refused unless
    ``allow_signer_change``, and then the change is recorded in the registry and the audit
    log."""
    limits = limits or Limits()
    registry = Registry.load(home)
    with open_package(path) as reader:
        manifest, signer = read_manifest(reader, trusted)
        where = Location(str(path))
        pinned = registry.signers.get(manifest.name)
        _check(manifest, reader.size, limits, path, signer, pinned, allow_signer_change)
        current = registry.active.get(manifest.name)
        digest = hashlib.sha256(reader.manifest_bytes).hexdigest()
        same = _installed_already(manifest, digest, registry, where)
        if same is not None:
            return same, f"{manifest.name} version {manifest.version} already installed"
        final = _unpack(reader, manifest, registry.root / manifest.name, path)
    installed = InstalledPackage(
        name=manifest.name,
        version=manifest.version,
        path=str(final),
        package_file=str(path.resolve()),
        signer=signer,
        manifest_sha256=digest,
        installed_at=time.time(),
    )
    changed = _record(registry, installed, pinned)
    if current is not None and current.path != installed.path:
        remove_tree(Path(current.path))
    if store is not None:
        register(store, installed, home)
    lines = [
        f"installed {manifest.name} version {manifest.version} ({len(manifest.files)} files, "
        f"{manifest.total_bytes} bytes) into {final}; signed by {signer}"
        + (" (its signer is pinned now)" if pinned is None else "")
    ]
    if changed:
        audit(home, "signer_changed", name=manifest.name, version=manifest.version,
              previous_signer=pinned, signer=signer, package=installed.package_file)  # fmt: skip
        lines.append(
            f"signer of {manifest.name} changed from {pinned} to {signer} "
            f"(--allow-signer-change): recorded in {registry.root / REGISTRY_FILE} and "
            f"{home / AUDIT_FILE}"
        )
    return installed, "\n".join(lines)


def _check(
    manifest: Manifest,
    size: int,
    limits: Limits,
    path: Path,
    signer: str,
    pinned: str | None,
    allow_signer_change: bool,
) -> None:
    """Refuse the package ``path`` (``size`` bytes) unless its signed sizes are within
    ``limits``, it holds what a model package must (:data:`REQUIRED_MEMBERS`) and ``signer``
    is its model's ``pinned`` signer (another only with ``allow_signer_change``)."""
    where = Location(str(path))
    try:
        limits.check(manifest, size)
    except ArchiveError as exc:
        raise refused(exc, path) from None
    missing = [m for m in REQUIRED_MEMBERS if m not in manifest.by_path()]
    if missing:
        raise PackageError(
            f"not a model package: the manifest lists no {', '.join(missing)}", location=where
        )
    if pinned is not None and pinned != signer and not allow_signer_change:
        raise PackageError(
            f"{manifest.name} is pinned to signer {pinned}, the key it was first installed "
            f"with; this package (version {manifest.version}) is signed by {signer}: "
            "refused, a package from another signer replaces a model only with "
            "--allow-signer-change",
            location=where,
        )


def _installed_already(
    manifest: Manifest, digest: str, registry: Registry, where: Location
) -> InstalledPackage | None:
    """The installed package when it is this very package (manifest digest ``digest``),
    else None; :class:`PackageError` when its version is older than one installed here
    (rollback protection) or is installed with other contents."""
    highest = registry.highest.get(manifest.name, 0)
    current = registry.active.get(manifest.name)
    if manifest.version < highest:
        raise PackageError(
            f"{manifest.name} version {manifest.version} is older than version {highest}, "
            "which was installed here; older packages are refused (rollback protection)",
            location=where,
        )
    if manifest.version == highest and current is not None:
        if current.manifest_sha256 == digest and Path(current.path).is_dir():
            return current
        raise PackageError(
            f"{manifest.name} version {manifest.version} is already installed with other "
            "contents; a new package needs a higher version",
            location=where,
        )
    return None


def _unpack(reader: ArchiveReader, manifest: Manifest, root: Path, path: Path) -> Path:
    """Stream the package's files (each hashed as it is written) into a staging directory
    under ``root`` (``packages/<name>``), make them read-only and rename it to
    ``root/<version>``, which it returns. Any failure removes the staging directory, and
    ``root`` when it made it: nothing is half-installed."""
    new_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".staging-{os.getpid()}-{manifest.version}"
    done = False
    try:
        free = shutil.disk_usage(root).free
        if manifest.total_bytes > free:
            raise PackageError(
                f"needs {manifest.total_bytes} bytes; {free} are free under {root}",
                location=Location(str(path)),
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
        (staging / MANIFEST).write_bytes(reader.manifest_bytes)
        (staging / SIGNATURE).write_bytes(reader.signature)
        _make_read_only(staging, _created_epoch(manifest))
        final = root / str(manifest.version)
        remove_tree(final)
        os.replace(staging, final)
        done = True
    finally:
        remove_tree(staging)
        if new_root and not done:  # refused: leave no packages/<name>/ behind either
            remove_tree(root)
    return final


def _record(registry: Registry, installed: InstalledPackage, pinned: str | None) -> bool:
    """Record ``installed`` as its model's active, highest version and pin its signer, with
    the change from ``pinned`` when there is one (returned: whether there is), and save."""
    name = installed.name
    registry.highest[name] = installed.version
    registry.active[name] = installed
    registry.signers[name] = installed.signer
    changed = pinned is not None and pinned != installed.signer
    if changed:
        registry.signer_changes.append(
            {
                "name": name,
                "version": installed.version,
                "from": pinned,
                "to": installed.signer,
                "at": installed.installed_at,
                "package": installed.package_file,
            }
        )
    registry.save()
    return changed


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


def repair(
    home: Path, trusted: TrustedKeys, packages: dict[str, Path] | None = None
) -> list[dict[str, Any]]:
    """Re-verify every installed package; restore damaged or missing files from its package
    file (``packages`` overrides where a model's package file is) and remove what the
    manifest does not list."""
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
                left = damage
                for _round in range(2):  # a restored manifest lets the files be checked
                    result["restored"] += _restore(installed, left, source, trusted)
                    left = check_installed(installed, trusted)
                    if not left:
                        break
                    result["damaged"] += [asdict(d) for d in left if asdict(d) not in
                                          result["damaged"]]  # fmt: skip
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
        restored: list[str] = []
        if "." in wanted:  # the folder itself is gone, a link or a file: made again, whole
            if base.is_symlink() or (base.exists() and not base.is_dir()):
                base.unlink()
            base.mkdir(parents=True, exist_ok=True)
            wanted = {f.path for f in manifest.files} | {MANIFEST, SIGNATURE}
            restored.append(".")
        real_base = os.path.realpath(base)
        make_writable(base)
        try:
            listed = manifest.by_path()
            # first what the manifest does not list (an extra file, directory or link, a
            # file or link where a directory belongs): removed, never followed
            for rel in sorted(wanted - set(listed), key=lambda r: (r.count("/"), r)):
                path = base / rel
                if path.is_symlink() or (path.exists() and not path.is_dir()):
                    path.unlink()
                elif path.is_dir():
                    make_writable(path)
                    shutil.rmtree(path)
                if rel in (MANIFEST, SIGNATURE):
                    data = reader.manifest_bytes if rel == MANIFEST else reader.signature
                    path.write_bytes(data)
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
                        if os.path.realpath(target.parent) != os.path.join(
                            real_base, *entry.path.split("/")[:-1]
                        ):
                            raise PackageError(
                                f"will not restore {entry.path!r}: its directory leads "
                                "outside the package",
                                location=Location(str(base)),
                            )
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
