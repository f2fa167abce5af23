"""Weights derived from a signed package in the plan cache, and the daemon's seals of them.

A signed package served in another dtype or quantization than it was packed in runs from
weights a worker derived from it (:mod:`kunlun.engine.convert`) into a plan-cache entry
(``KUNLUN_HOME/plan-cache/<key>/``): unsigned files, which with ``--require-signed``
:class:`~kunlun.offline.integrity.ModelGuard` seals and checks. This module is the files'
side of it; when to seal, check, discard or stop is the guard's:

- :class:`Conversion`: an entry, the package it was derived from, the workloads started from
  it and its files as sealed;
- :func:`derived_files` hashes every artifact of an entry (a link is recorded, never
  followed); :func:`compare_files` says how they differ from a seal, one line per file;
- :func:`made_problems` checks a conversion just made against the SHA-256 it took of each
  file as it wrote them, and that its links stay inside the package;
- :func:`make_read_only` and :func:`discard` act on an entry's artifacts;
- the seal, ``KUNLUN_HOME/integrity/conversions/<key>.json`` (mode 0600, outside the plan
  cache, tied to the package's signed manifest digest and the cache key): :func:`write_seal`,
  :func:`read_seal` (one of another user, readable by others, or for another package,
  version or entry does not count) and :func:`seal_changed`.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from kunlun.offline.registry import InstalledPackage
from kunlun.paths import CONVERSION_RECORD, remove_tree
from kunlun.planner.cache import artifacts

CONVERSIONS_DIR = Path("integrity") / "conversions"
"""The daemon's seals of converted weights, ``<plan-cache key>.json`` (mode 0600)."""
SEAL_FORMAT = 1


@dataclass
class Conversion:
    """Files a worker derived from a signed package into a plan-cache entry."""

    key: str
    entry: Path
    package: InstalledPackage
    workloads: set[str] = field(default_factory=set)
    """Workloads whose replicas were started from it."""
    files: dict[str, str] | None = None
    """As sealed: path in the entry -> ``sha256:<hex>`` or ``link:<target>``; None while a
    worker is making them (not sealed yet)."""
    problems: list[str] = field(default_factory=list)
    """What the last check found (kept until the conversion is made again and sealed)."""


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def derived_files(entry: Path) -> dict[str, str]:
    """Every conversion artifact in the plan-cache entry ``entry``
    (:func:`~kunlun.planner.cache.artifacts`), recursively: path in the entry ->
    ``sha256:<hex>`` (a regular file), ``link:<target>`` (a symbolic link, not followed) or
    ``special`` (anything else), ``unreadable: <why>``."""
    found: dict[str, str] = {}

    def walk(path: Path, rel: str) -> None:
        try:
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                found[rel] = "link:" + os.readlink(path)
            elif stat.S_ISDIR(info.st_mode):
                for child in sorted(os.listdir(path)):
                    walk(path / child, f"{rel}/{child}")
            elif stat.S_ISREG(info.st_mode):
                found[rel] = "sha256:" + _sha256(path)
            else:
                found[rel] = "special"
        except FileNotFoundError:  # removed meanwhile: missing
            return
        except OSError as exc:
            found[rel] = f"unreadable: {exc.strerror or exc}"

    for top in artifacts(entry):
        walk(top, top.name)
    return found


def compare_files(sealed: dict[str, str], found: dict[str, str], where: str) -> list[str]:
    """How ``found`` differs from ``sealed`` (:func:`derived_files`), one problem per file,
    each named ``where/<path>``."""
    problems = []
    for rel in sorted(sealed.keys() | found.keys()):
        want, got = sealed.get(rel), found.get(rel)
        if want == got:
            continue
        if got is None:
            problems.append(f"{where}/{rel}: missing")
        elif want is None:
            problems.append(f"{where}/{rel}: added after the conversion was sealed")
        elif got.startswith("unreadable"):
            problems.append(f"{where}/{rel}: {got}")
        elif got.startswith("link:") or want.startswith("link:"):
            problems.append(f"{where}/{rel}: now {_what(got)}, sealed as {_what(want)}")
        else:
            problems.append(f"{where}/{rel}: content differs from its SHA-256 when sealed")
    return problems


def _what(value: str) -> str:
    if value.startswith("link:"):
        return f"a link to {value.removeprefix('link:')}"
    return "a regular file" if value.startswith("sha256:") else "not a regular file"


def make_read_only(entry: Path) -> None:
    """The artifacts of ``entry`` read-only for their owner too (files 0400, directories
    0500: no group or other bits, which the daemon's start would take away)."""
    for top in artifacts(entry):
        if top.is_symlink():
            continue
        if not top.is_dir():
            os.chmod(top, 0o400)
            continue
        for root, _dirs, files in os.walk(top, topdown=False):
            for name in files:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o400)
            os.chmod(root, 0o500)


def discard(entry: Path) -> None:
    """Remove the artifacts of ``entry``; :class:`OSError` naming those left."""
    for top in artifacts(entry):
        if top.is_dir() and not top.is_symlink():
            remove_tree(top)
        else:
            top.unlink(missing_ok=True)
    left = artifacts(entry)
    if left:
        raise OSError(f"cannot remove {', '.join(str(p) for p in left)}")


def in_home(home: Path, path: Path) -> str:
    """``path`` relative to ``home`` when inside it (as the audit log names files)."""
    try:
        return str(path.relative_to(home))
    except ValueError:
        return str(path)


def made_problems(entry: Path, found: dict[str, str], package: Path, where: str) -> list[str]:
    """How the conversion just made in ``entry`` (``found``: :func:`derived_files`) is not
    what it made: a link that leads outside ``package`` (the installed package it was
    converted from), a file that is not a readable regular file, and in each folder with a
    conversion record (:data:`~kunlun.paths.CONVERSION_RECORD`) a file it does not list or
    whose content differs from the SHA-256 it took as it wrote it. Each problem is named
    ``where/<path>``."""
    problems = []
    package = package.resolve()
    for rel, value in found.items():
        if value.startswith("link:"):
            target = (entry / rel).parent / value.removeprefix("link:")
            if not target.resolve().is_relative_to(package):
                problems.append(f"{where}/{rel}: links outside the package ({target})")
        elif not value.startswith("sha256:"):
            problems.append(f"{where}/{rel}: not a readable regular file ({value})")
        if Path(rel).name != CONVERSION_RECORD:
            continue
        folder = str(Path(rel).parent)
        try:
            made = json.loads((entry / rel).read_text(encoding="utf-8"))["sha256"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"{where}/{rel}: no SHA-256 of the files made ({exc!r})")
            continue
        for other, value2 in found.items():
            if str(Path(other).parent) != folder or value2.startswith("link:"):
                continue
            name = Path(other).name
            if name == CONVERSION_RECORD:
                continue
            if name not in made:
                problems.append(f"{where}/{other}: not made by the conversion")
            elif value2 != "sha256:" + str(made[name]):
                problems.append(f"{where}/{other}: content differs from its SHA-256 when made")
    return problems


def read_seal(
    home: Path, key: str, installed: InstalledPackage
) -> tuple[dict[str, str] | None, str]:
    """The files of this daemon's seal of entry ``key`` for ``installed``, or None and why
    there is none that counts."""
    path = home / CONVERSIONS_DIR / f"{key}.json"
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None, f"its seal {in_home(home, path)} is not a file of this user"
        if stat.S_IMODE(info.st_mode) & 0o077:
            return None, f"its seal {in_home(home, path)} is readable by others"
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, "not sealed: made without --require-signed, or its seal is gone"
    except (OSError, ValueError) as exc:
        return None, f"its seal {in_home(home, path)} is unreadable ({exc})"
    wanted = {"format": SEAL_FORMAT, "key": key, "package": installed.name,
              "version": installed.version, "manifest_sha256": installed.manifest_sha256}  # fmt: skip
    if not isinstance(data, dict) or any(data.get(k) != v for k, v in wanted.items()):
        return None, "sealed for another package, version or entry"
    files = data.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        return None, f"its seal {in_home(home, path)} lists no files"
    return files, ""


def write_seal(home: Path, conversion: Conversion, files: dict[str, str]) -> None:
    """Seal ``conversion`` with ``files`` (:func:`derived_files`): its seal file written
    whole (a temporary file renamed), mode 0600."""
    installed = conversion.package
    folder = home / CONVERSIONS_DIR
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = {"format": SEAL_FORMAT, "key": conversion.key, "package": installed.name,
            "version": installed.version, "manifest_sha256": installed.manifest_sha256,
            "signer": installed.signer, "entry": str(conversion.entry),
            "sealed_at": round(time.time(), 3), "files": files}  # fmt: skip
    path = folder / f"{conversion.key}.json"
    temporary = folder / f".{path.name}.{os.getpid()}.tmp"
    temporary.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(temporary, flags, 0o600), "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
    os.replace(temporary, path)


def seal_changed(home: Path, conversion: Conversion) -> list[str]:
    """The on-disk seal must say what this daemon sealed (when it did, this run)."""
    sealed, why = read_seal(home, conversion.key, conversion.package)
    if sealed == conversion.files:
        return []
    path = in_home(home, home / CONVERSIONS_DIR / f"{conversion.key}.json")
    return [f"{path}: differs from the seal this daemon wrote" + (f" ({why})" if why else "")]
