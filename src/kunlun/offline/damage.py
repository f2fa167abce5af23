"""How an installed package differs from its signed manifest (:func:`check_installed`).

Each difference is one :class:`Damage`, a path in the install directory and what is wrong
there: a listed file missing, changed, or of another kind (a directory, a link); a directory
the manifest needs that is a file or a link; anything the manifest does not list (a file, a
directory, a link, wherever it points, a FIFO). The folder is walked without following a
link. ``kunlun-installer --repair`` (:func:`kunlun.offline.install.repair`) restores what this
finds, and the daemon's re-hash (:mod:`.integrity`) refuses or stops a model over it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun.errors import SignatureError
from kunlun.offline.archive import hash_file
from kunlun.offline.manifest import MANIFEST, SIGNATURE, FileEntry, Manifest, ManifestError, parse
from kunlun.offline.registry import InstalledPackage
from kunlun.offline.signing import TrustedKeys


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
    manifest = _installed_manifest(installed, trusted, base, real_base)
    if isinstance(manifest, Damage):
        return [manifest]
    damage: list[Damage] = []
    listed = manifest.by_path()
    dirs = _parents(listed)
    found = _walk(base, damage)
    damage += _not_directories(base, real_base, dirs, found)
    damage += _listed_damage(base, real_base, manifest.files, found)
    damage += _unlisted(base, real_base, found, listed, dirs)
    return damage


def _installed_manifest(
    installed: InstalledPackage, trusted: TrustedKeys | None, base: Path, real_base: str
) -> Manifest | Damage:
    """The manifest of the folder ``base``, when the folder is one, its manifest is the one
    that was installed and (with ``trusted``) its signature verifies; else the one
    :class:`Damage` that leaves nothing else to check."""
    if base.is_symlink() or not base.is_dir():
        what = _link(str(base), str(base.parent)) if base.is_symlink() else "missing"
        if base.exists() and not base.is_symlink():
            what = _kind(base.lstat().st_mode)
        return Damage(".", f"the package folder is {what}")
    for name in (MANIFEST, SIGNATURE):
        if (base / name).is_symlink():
            return Damage(name, f"{_link(str(base / name), real_base)}, not the installed file")
    try:
        data = (base / MANIFEST).read_bytes()
        signature = (base / SIGNATURE).read_bytes()
    except OSError as exc:
        return Damage(MANIFEST, f"unreadable: {exc.strerror}")
    if hashlib.sha256(data).hexdigest() != installed.manifest_sha256:
        return Damage(MANIFEST, "differs from the manifest that was installed")
    if trusted is not None:
        try:
            trusted.verify(data, signature, str(base / MANIFEST))
        except SignatureError as exc:  # the manifest is the one installed: its .sig changed?
            return Damage(SIGNATURE, f"does not verify: {exc.message}")
    try:
        return parse(data, str(base / MANIFEST))
    except ManifestError as exc:  # installed before a rule it breaks: repair refuses it
        return Damage(MANIFEST, f"cannot be used: {exc}")


def _walk(base: Path, damage: list[Damage]) -> dict[str, int]:
    """What is there, by relative path: its mode (``lstat``), walked without following a
    link; a directory that cannot be read is appended to ``damage``."""
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
    return found


def _not_directories(
    base: Path, real_base: str, dirs: set[str], found: dict[str, int]
) -> list[Damage]:
    """Each directory the manifest needs (``dirs``) that is something else."""
    damage = []
    for rel in sorted(dirs):
        mode = found.get(rel)
        if mode is not None and not stat.S_ISDIR(mode):
            what = _link(str(base / rel), real_base) if stat.S_ISLNK(mode) else _kind(mode)
            damage.append(Damage(rel, f"{what}, where the manifest expects a directory"))
    return damage


def _listed_damage(
    base: Path, real_base: str, files: list[FileEntry], found: dict[str, int]
) -> list[Damage]:
    """Each file the manifest lists that is missing, not a regular file, or changed."""
    damage = []
    for entry in files:
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
    return damage


def _unlisted(
    base: Path, real_base: str, found: dict[str, int], listed: dict[str, FileEntry], dirs: set[str]
) -> list[Damage]:
    """What the manifest does not list; what is inside an extra directory (or a directory
    where a file belongs) is not named on its own."""
    damage = []
    for rel, mode in sorted(found.items()):
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
