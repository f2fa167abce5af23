"""Installing model packages into ``KUNLUN_HOME`` (``kunlun-installer install --package``).

A package is verified and unpacked in one pass: its signature first (trusted keys), then the
:class:`~kunlun.offline.archive.Limits` from the signed sizes, then its signer (pinned per
model at its first install: another key's package is refused unless
``--allow-signer-change``, which is recorded), then the version (never older
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
damaged or missing files from the package file, and removes anything the manifest does not
list: a file, a directory, a symbolic link (never followed, wherever it points).
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

from kunlun.errors import Location, PackageError, SignatureError
from kunlun.offline.archive import ArchiveError, Limits, hash_file, refused
from kunlun.offline.bootstrap import AUDIT_FILE, audit
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
from kunlun.paths import READ_ONLY_DIR, make_writable, remove_tree

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
    """``packages/installed.json``: each model's installed package, highest version and
    pinned signer (the fingerprint of the key its first version was installed with; a
    registry written before pins existed pins each model to its installed signer)."""

    root: Path
    highest: dict[str, int] = field(default_factory=dict)
    active: dict[str, InstalledPackage] = field(default_factory=dict)
    signers: dict[str, str] = field(default_factory=dict)
    signer_changes: list[dict[str, Any]] = field(default_factory=list)
    """Every ``--allow-signer-change``: model, version, old and new signer, when, package."""

    @classmethod
    def load(cls, home: Path) -> Registry:
        root = home / PACKAGES_DIR
        path = root / REGISTRY_FILE
        if not path.is_file():
            return cls(root)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            active = {k: InstalledPackage(**v) for k, v in raw["active"].items()}
            signers = {str(k): str(v) for k, v in (raw.get("signers") or {}).items()}
            for name, installed in active.items():
                signers.setdefault(name, installed.signer)
            changes = raw.get("signer_changes") or []
            if not isinstance(changes, list):
                raise TypeError("signer_changes is not a list")
            return cls(root, {k: int(v) for k, v in raw["highest"].items()}, active, signers,
                       changes)  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
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
            "signers": dict(sorted(self.signers.items())),
            "signer_changes": self.signer_changes,
        }
        path = self.root / REGISTRY_FILE
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(temporary, path)


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
        pinned = registry.signers.get(manifest.name)
        if pinned is not None and pinned != signer and not allow_signer_change:
            raise PackageError(
                f"{manifest.name} is pinned to signer {pinned}, the key it was first installed "
                f"with; this package (version {manifest.version}) is signed by {signer}: "
                "refused, a package from another signer replaces a model only with "
                "--allow-signer-change",
                location=where,
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
    registry.signers[manifest.name] = signer
    changed = pinned is not None and pinned != signer
    if changed:
        registry.signer_changes.append(
            {
                "name": manifest.name,
                "version": manifest.version,
                "from": pinned,
                "to": signer,
                "at": installed.installed_at,
                "package": installed.package_file,
            }
        )
    registry.save()
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


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFREG: "a file", stat.S_IFLNK: "a symbolic link",
          stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device",
          stat.S_IFBLK: "a device"}  # fmt: skip


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def _link(path: str, real_base: str) -> str:
    """``a symbolic link to 'T'``, and where ``T`` leads when it leaves the package."""
    target = os.readlink(path)
    resolved = os.path.realpath(path)
    inside = resolved == real_base or resolved.startswith(real_base + os.sep)
    where = "" if inside else ", which points outside the package"
    return f"a symbolic link to {target!r}{where}"


def _parents(paths: Any) -> set[str]:
    """Every directory the relative ``paths`` need (``a/b/c`` needs ``a`` and ``a/b``)."""
    dirs: set[str] = set()
    for path in paths:
        parts = path.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return dirs


def check_installed(installed: InstalledPackage, trusted: TrustedKeys | None) -> list[Damage]:
    """Every way the installed folder differs from the signed manifest (empty: intact): a
    listed file missing, changed, or of another kind (a directory, a link); a directory the
    manifest needs that is a file or a link; and anything the manifest does not list (a
    file, a directory, a link, wherever it points, a FIFO). With ``trusted``, the installed
    manifest's signature is checked first."""
    base = Path(installed.path)
    real_base = os.path.realpath(base)
    if base.is_symlink() or not base.is_dir():
        what = _link(str(base), str(base.parent)) if base.is_symlink() else "missing"
        if base.exists() and not base.is_symlink():
            what = _kind(base.lstat().st_mode)
        return [Damage(".", f"the package folder is {what}")]
    for name in (MANIFEST, SIGNATURE):
        if (base / name).is_symlink():
            return [Damage(name, f"{_link(str(base / name), real_base)}, not the installed file")]
    try:
        data = (base / MANIFEST).read_bytes()
        signature = (base / SIGNATURE).read_bytes()
    except OSError as exc:
        return [Damage(MANIFEST, f"unreadable: {exc.strerror}")]
    if hashlib.sha256(data).hexdigest() != installed.manifest_sha256:
        return [Damage(MANIFEST, "differs from the manifest that was installed")]
    if trusted is not None:
        try:
            trusted.verify(data, signature, str(base / MANIFEST))
        except SignatureError as exc:  # the manifest is the one installed: its .sig changed?
            return [Damage(SIGNATURE, f"does not verify: {exc.message}")]
    try:
        manifest = parse(data, str(base / MANIFEST))
    except ManifestError as exc:  # installed before a rule it breaks: repair refuses it
        return [Damage(MANIFEST, f"cannot be used: {exc}")]
    damage: list[Damage] = []
    listed = manifest.by_path()
    dirs = _parents(listed)
    # what is there, by relative path: walked without following a link
    found: dict[str, int] = {}

    def cannot_read(exc: OSError) -> None:
        rel = os.path.relpath(str(exc.filename), base).replace(os.sep, "/")
        damage.append(Damage(rel, f"unreadable directory: {exc.strerror}"))

    for root, dirnames, filenames in os.walk(base, onerror=cannot_read):
        for name in dirnames + filenames:
            path = os.path.join(root, name)
            try:
                found[os.path.relpath(path, base).replace(os.sep, "/")] = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
    for rel in sorted(dirs):  # each directory the manifest needs
        mode = found.get(rel)
        if mode is not None and not stat.S_ISDIR(mode):
            what = _link(str(base / rel), real_base) if stat.S_ISLNK(mode) else _kind(mode)
            damage.append(Damage(rel, f"{what}, where the manifest expects a directory"))
    for entry in manifest.files:  # each file it lists
        rel = entry.path
        mode = found.get(rel)
        blocked = next((d for d in sorted(_parents([rel])) if not stat.S_ISDIR(found.get(d, 0))),
                       None)  # fmt: skip
        if blocked is not None and blocked in found:
            damage.append(Damage(rel, f"missing ({blocked!r} is not a directory)"))
        elif mode is None:
            damage.append(Damage(rel, "missing"))
        elif stat.S_ISLNK(mode):
            damage.append(Damage(rel, f"{_link(str(base / rel), real_base)}, not the signed file"))
        elif stat.S_ISDIR(mode):
            damage.append(Damage(rel, "a directory where the manifest lists a file"))
        elif not stat.S_ISREG(mode):
            damage.append(Damage(rel, f"{_kind(mode)}, not a regular file"))
        else:
            try:
                size, digest = hash_file(base / rel)
            except OSError as exc:
                damage.append(Damage(rel, f"unreadable: {exc.strerror}"))
                continue
            if size != entry.size or digest != entry.sha256:
                damage.append(Damage(rel, "content differs from its SHA-256"))
    for rel, mode in sorted(found.items()):  # what it does not list
        if rel in listed or rel in dirs or rel in (MANIFEST, SIGNATURE):
            continue
        if any(d not in dirs for d in _parents([rel])):
            continue  # inside an extra directory (or a directory where a file belongs)
        if stat.S_ISLNK(mode):
            what = f"extra {_link(str(base / rel), real_base)[2:]}"
        elif stat.S_ISDIR(mode):
            held = sum(1 for other in found if other.startswith(rel + "/"))
            what = "extra directory" + (f" holding {held} entries" if held else "")
        elif stat.S_ISREG(mode):
            what = "extra file"
        else:
            what = f"extra {_kind(mode)[2:]}"
        damage.append(Damage(rel, f"{what}, not in the manifest"))
    return damage


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
