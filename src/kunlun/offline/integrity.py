"""Zero-trust serving: what the daemon serves is checked at every start and every 5 minutes.

:class:`ModelGuard` is asked before a workload is recorded (``admit``) and again before its
replicas start (``admit`` with ``rehash``): with ``--require-signed`` only models installed
from a signed package (``kunlun-installer``) are served, a plain local directory is refused
with the reason; a package's manifest must verify with a trusted key and, at start, every
installed file must still match its signed SHA-256.

:meth:`ModelGuard.sweep` (the daemon runs it at start and every ``--integrity-interval``
seconds, 300 by default) re-hashes the installed packages behind the active workloads and the
platform's own installed files (the wheel's ``RECORD``; an editable install has none and is
reported as not checkable). A mismatch stops serving that model: its workloads end FAILED
with the reason (``workload describe``), the finding is appended to
``KUNLUN_HOME/logs/audit.jsonl`` and counted in ``/metrics``
(``kunlun_integrity_ok``, ``kunlun_integrity_failures_total``). ``kunlun-installer --repair``
restores the files; the next start re-checks them.

A signed package served in another dtype or quantization than it was packed in runs from
weights derived from it (:mod:`kunlun.engine.convert`) in the plan cache
(``KUNLUN_HOME/plan-cache/<key>/``): unsigned files, so with ``--require-signed`` the daemon
seals them. When the worker that made them is ready, :meth:`ModelGuard.seal` checks them
against the SHA-256 the conversion took as it wrote them, makes them read-only and records
the SHA-256 of every derived file (and every link's target) in
``KUNLUN_HOME/integrity/conversions/<key>.json`` (mode 0600, outside the plan cache, tied to
the package's signed manifest digest and the cache key), and keeps them in memory.
:meth:`ModelGuard.check_conversion`, before any replica starts from that entry, re-hashes
them against the seal: a conversion with no seal is discarded (``discarded``), one that
differs is discarded too and reported (``tampered``, naming each file; the integrity metric
of ``kind="conversion"`` goes to 0), and the worker converts again from the signed package,
re-hashed just before. The sweep re-hashes the sealed conversions of the active workloads and
stops those whose files changed, as for a package.

This is as far as userspace goes: it detects changed files, not a process or kernel already
subverted.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kunlun.errors import ConfigError, KunlunError, Location, PermissionDenied
from kunlun.offline.bootstrap import TRUSTED_KEYS_DIR
from kunlun.offline.install import InstalledPackage, Registry, check_installed
from kunlun.offline.signing import TrustedKeys, verify_file
from kunlun.paths import CONVERSION_RECORD, remove_tree
from kunlun.planner.cache import artifacts

AUDIT_FILE = Path("logs") / "audit.jsonl"
CONVERSIONS_DIR = Path("integrity") / "conversions"
"""The daemon's seals of converted weights, ``<plan-cache key>.json`` (mode 0600)."""
SEAL_FORMAT = 1
DEFAULT_INTERVAL_S = 300.0
PLATFORM_DIST = "kunlun-platform"


class IntegrityError(KunlunError):
    """The platform's own installed files do not match their hashes: the daemon does not start."""

    code = "daemon.integrity"
    exit_code = 2


class AuditLog:
    """``KUNLUN_HOME/logs/audit.jsonl``: one JSON object per line, appended and flushed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.write_errors = 0

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ts": round(time.time(), 3), "event": event, **fields}) + "\n"
        with self._lock:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as handle:
                    handle.write(line)
            except OSError as exc:  # counted and reported once per failure, never raised
                self.write_errors += 1
                print(f"audit log {self.path}: cannot write ({exc.strerror}): {line}", flush=True)


@dataclass
class Finding:
    kind: str
    """``package``, ``platform`` or ``conversion`` (weights derived from package ``name``)."""
    name: str
    problems: list[str]
    version: int | None = None
    workloads: list[str] | None = None
    """The workloads it stops when not ok (None: every workload of ``name``)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        what = self.name if self.version is None else f"{self.name} version {self.version}"
        return f"{self.kind} {what}: " + "; ".join(self.problems)


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


def _make_read_only(entry: Path) -> None:
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


def _discard(entry: Path) -> None:
    for top in artifacts(entry):
        if top.is_dir() and not top.is_symlink():
            remove_tree(top)
        else:
            top.unlink(missing_ok=True)
    left = artifacts(entry)
    if left:
        raise OSError(f"cannot remove {', '.join(str(p) for p in left)}")


@dataclass
class ModelGuard:
    home: Path
    trusted: TrustedKeys | None = None
    require_signed: bool = False
    audit: AuditLog = field(init=False)
    status: dict[tuple[str, str], bool] = field(default_factory=dict)
    failures: dict[tuple[str, str], int] = field(default_factory=dict)
    checks: int = 0
    last_check: float = 0.0
    _said_not_checkable: bool = False
    conversions: dict[str, Conversion] = field(default_factory=dict)
    """Conversions of signed packages this daemon started replicas from, by cache key."""
    stops: list[Finding] = field(default_factory=list)
    """Findings of :meth:`check_conversion` whose workloads must stop (taken by the caller)."""
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        self.audit = AuditLog(self.home / AUDIT_FILE)

    # ---- admission ----
    def package_of(self, path: Path) -> InstalledPackage | None:
        """The installed package whose model directory ``path`` is, if any."""
        resolved = path.resolve()
        for installed in Registry.load(self.home).active.values():
            if installed.model_dir.resolve() == resolved:
                return installed
        return None

    def admit(self, name: str, path: Path, *, rehash: bool) -> None:
        """Raise :class:`PermissionDenied` when ``name`` (at ``path``) may not be served."""
        installed = self.package_of(path)
        if installed is None:
            if self.require_signed:
                reason = (
                    f"model {name!r} ({path}) is not an installed signed package; with "
                    "--require-signed only packages installed by kunlun-installer are served"
                )
                self.audit.write("refused", model=name, path=str(path), reason=reason)
                raise PermissionDenied(
                    reason,
                    location=Location("model"),
                    hint="kunlun-cli model pack ... then kunlun-installer install --package P",
                )
            return
        finding = self._check_package(installed, rehash)
        if not finding.ok:
            self.audit.write("refused", model=name, reason=finding.describe())
            raise PermissionDenied(
                f"model {name!r} fails its integrity check: {finding.describe()}",
                location=Location(installed.path),
                hint="kunlun-installer --repair",
            )
        if rehash:
            self.audit.write("verified", kind="package", name=installed.name,
                             version=installed.version, signer=installed.signer)  # fmt: skip

    def _check_package(self, installed: InstalledPackage, rehash: bool) -> Finding:
        problems: list[str] = []
        try:
            if rehash:
                damage = check_installed(installed, self.trusted)
                problems = [f"{d.path}: {d.problem}" for d in damage]
            elif self.trusted is not None:
                base = Path(installed.path)
                self.trusted.verify((base / "manifest.json").read_bytes(),
                                    (base / "manifest.sig").read_bytes(),
                                    str(base / "manifest.json"))  # fmt: skip
        except (KunlunError, OSError, ValueError) as exc:
            problems = [str(exc)]
        finding = Finding("package", installed.name, problems, installed.version)
        self._count(finding)
        return finding

    def _count(self, finding: Finding) -> None:
        key = (finding.kind, finding.name)
        self.status[key] = finding.ok
        if not finding.ok:
            self.failures[key] = self.failures.get(key, 0) + 1

    # ---- weights derived from a package (the plan cache) ----
    def check_conversion(self, name: str, path: Path, entry: Path, workload_id: str) -> str | None:
        """Before a replica of workload ``workload_id`` (model ``name`` at ``path``) starts
        from the plan-cache entry ``entry``. With ``--require-signed`` and a package: what the
        entry holds derived from it must match this daemon's seal, or is discarded (the
        worker then converts again from the signed package, re-hashed just before; it is
        sealed when that worker is ready). Returns a line for the workload's log, or None.
        Raises :class:`PermissionDenied` when a discarded conversion cannot be removed. A
        conversion another workload's replica made, found changed before its seal, is
        discarded too and its finding left in :attr:`stops` for the caller to stop them."""
        if not self.require_signed:
            return None
        installed = self.package_of(path)
        if installed is None:
            return None
        key, where = entry.name, self._where(entry)
        with self._lock:
            known = self.conversions.get(key)
            if known is not None and known.package.manifest_sha256 != installed.manifest_sha256:
                known = None
            conversion = Conversion(key, entry, installed, {workload_id})
            if known is not None:
                known.workloads.add(workload_id)
                conversion = known
            self.conversions[key] = conversion
            if not artifacts(entry):
                return None  # nothing made yet: the worker converts (if the plan needs it)
            if conversion.files is None:
                if known is not None:  # made by a replica of ours, not ready yet: seal it now
                    bad = self._seal(conversion)
                    if bad is None:
                        return None
                    others = sorted(conversion.workloads - {workload_id})
                    if others:  # they may have loaded the changed files: they stop
                        self.stops.append(Finding("conversion", installed.name, bad,
                                                  installed.version, others))  # fmt: skip
                    return self._line(where, bad)
                sealed, why = self._read_seal(key, installed)
                if sealed is None:
                    self.audit.write("discarded", kind="conversion", name=installed.name,
                                     version=installed.version, key=key, model=name,
                                     path=where, reason=why)  # fmt: skip
                    self._remove(entry, name)
                    return f"integrity: {where} discarded ({why}); converting it again"
                conversion.files = sealed
            started = time.monotonic()
            problems = self._seal_changed(conversion)
            problems += compare_files(conversion.files, derived_files(entry), where)
            seconds = round(time.monotonic() - started, 3)
            if problems:
                self._tampered(conversion, problems, name, seconds)
                self._remove(entry, name)
                return self._line(where, problems)
            conversion.problems = []
            self._conversion_status(installed.name)
            self.audit.write("verified", kind="conversion", name=installed.name,
                             version=installed.version, key=key, model=name,
                             files=len(conversion.files), seconds=seconds)  # fmt: skip
            return (
                f"integrity: {where} matches its seal ({len(conversion.files)} files, {seconds} s)"
            )

    def take_stops(self) -> list[Finding]:
        with self._lock:
            stops, self.stops = self.stops, []
        return stops

    def sealing(self, workload_id: str) -> bool:
        """Whether a conversion that replicas of ``workload_id`` started from awaits its seal.
        Without the lock (a sweep may hold it for seconds): asked on the event loop."""
        conversions = list(self.conversions.values())
        return any(c.files is None and workload_id in c.workloads for c in conversions)

    def seal(self, workload_id: str) -> list[Finding]:
        """A replica of ``workload_id`` is ready: seal the conversions it made (see
        :meth:`_seal`). Returns the findings of those that were changed since they were made
        (discarded; their workloads must stop)."""
        findings = []
        with self._lock:
            for conversion in list(self.conversions.values()):
                if conversion.files is None and workload_id in conversion.workloads:
                    bad = self._seal(conversion)
                    if bad is not None:
                        findings.append(Finding("conversion", conversion.package.name, bad,
                                                conversion.package.version,
                                                sorted(conversion.workloads)))  # fmt: skip
        return findings

    def _seal(self, conversion: Conversion) -> list[str] | None:
        """Check a conversion a worker just made against the SHA-256 it took of each file as
        it wrote them (``weights/conversion.json``) and that its links point into the
        package, then make it read-only and write its seal. Returns the problems (it is then
        discarded), or None."""
        entry, installed = conversion.entry, conversion.package
        if not artifacts(entry):  # the plan needed no conversion
            self.conversions.pop(conversion.key, None)
            return None
        started = time.monotonic()
        found = derived_files(entry)
        problems = self._as_made(entry, found, Path(installed.path))
        seconds = round(time.monotonic() - started, 3)
        if problems:  # its workloads stop; the next start converts it again
            self._tampered(conversion, problems, None, seconds)
            try:
                _discard(entry)
            except OSError as exc:
                problems.append(str(exc))
            return problems
        try:
            _make_read_only(entry)
            self._write_seal(conversion, found)
        except OSError as exc:  # not sealed: the next start discards it and converts again
            self.audit.write("not_sealed", kind="conversion", name=installed.name,
                             key=conversion.key, reason=str(exc))  # fmt: skip
            return None
        conversion.files, conversion.problems = found, []
        self._conversion_status(installed.name)
        self.audit.write("sealed", kind="conversion", name=installed.name,
                         version=installed.version, key=conversion.key,
                         path=self._where(entry), files=len(found), seconds=seconds)  # fmt: skip
        return None

    def _as_made(self, entry: Path, found: dict[str, str], package: Path) -> list[str]:
        where, problems = self._where(entry), []
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

    def _seal_changed(self, conversion: Conversion) -> list[str]:
        """The on-disk seal must say what this daemon sealed (when it did, this run)."""
        sealed, why = self._read_seal(conversion.key, conversion.package)
        if sealed == conversion.files:
            return []
        path = self._where(self.home / CONVERSIONS_DIR / f"{conversion.key}.json")
        return [f"{path}: differs from the seal this daemon wrote" + (f" ({why})" if why else "")]

    def _tampered(
        self, conversion: Conversion, problems: list[str], model: str | None, seconds: float
    ) -> None:
        installed = conversion.package
        conversion.problems = problems
        self.failures[("conversion", installed.name)] = (
            self.failures.get(("conversion", installed.name), 0) + 1
        )
        self._conversion_status(installed.name)
        self.audit.write("tampered", kind="conversion", name=installed.name,
                         version=installed.version, key=conversion.key, model=model,
                         path=self._where(conversion.entry), problems=problems,
                         seconds=seconds)  # fmt: skip

    def _remove(self, entry: Path, name: str) -> None:
        """Discard ``entry``'s artifacts before a replica starts: the worker converts again."""
        conversion = self.conversions[entry.name]
        conversion.files = None  # the problems stay (metric 0) until it is sealed again
        try:
            _discard(entry)
        except OSError as exc:
            reason = f"cannot discard the conversion {self._where(entry)}: {exc}"
            self.audit.write("refused", model=name, reason=reason)
            raise PermissionDenied(reason, location=Location(str(entry))) from exc

    def _line(self, where: str, problems: list[str]) -> str:
        return (f"integrity: {where} tampered: {'; '.join(problems)}; discarded, converting "
                "it again from the signed package")  # fmt: skip

    def _conversion_status(self, package: str) -> None:
        bad = any(c.problems for c in self.conversions.values() if c.package.name == package)
        self.status[("conversion", package)] = not bad

    def _where(self, path: Path) -> str:
        """``path`` relative to the home when inside it (as the audit log names files)."""
        try:
            return str(path.relative_to(self.home))
        except ValueError:
            return str(path)

    def _read_seal(
        self, key: str, installed: InstalledPackage
    ) -> tuple[dict[str, str] | None, str]:
        """The files of this daemon's seal of entry ``key`` for ``installed``, or None and why
        there is none that counts."""
        path = self.home / CONVERSIONS_DIR / f"{key}.json"
        try:
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                return None, f"its seal {self._where(path)} is not a file of this user"
            if stat.S_IMODE(info.st_mode) & 0o077:
                return None, f"its seal {self._where(path)} is readable by others"
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None, "not sealed: made without --require-signed, or its seal is gone"
        except (OSError, ValueError) as exc:
            return None, f"its seal {self._where(path)} is unreadable ({exc})"
        wanted = {"format": SEAL_FORMAT, "key": key, "package": installed.name,
                  "version": installed.version, "manifest_sha256": installed.manifest_sha256}  # fmt: skip
        if not isinstance(data, dict) or any(data.get(k) != v for k, v in wanted.items()):
            return None, "sealed for another package, version or entry"
        files = data.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()
        ):
            return None, f"its seal {self._where(path)} lists no files"
        return files, ""

    def _write_seal(self, conversion: Conversion, files: dict[str, str]) -> None:
        installed = conversion.package
        folder = self.home / CONVERSIONS_DIR
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

    def check_conversions(self, active: Collection[str]) -> list[Finding]:
        """The sweep's part: re-hash each sealed conversion a workload of ``active`` was
        started from; one finding per package, stopping the workloads of the changed ones."""
        active = set(active)
        by_package: dict[str, Finding] = {}
        with self._lock:
            for conversion in self.conversions.values():
                users = conversion.workloads & active
                if conversion.files is None or not users:
                    continue
                installed = conversion.package
                problems = self._seal_changed(conversion)
                problems += compare_files(conversion.files, derived_files(conversion.entry),
                                          self._where(conversion.entry))  # fmt: skip
                finding = by_package.setdefault(installed.name, Finding(
                    "conversion", installed.name, [], installed.version, []))  # fmt: skip
                if problems:
                    conversion.problems = problems
                    finding.problems += problems
                    finding.workloads = sorted({*(finding.workloads or []), *users})
            for name, finding in by_package.items():
                self._conversion_status(name)
                if not finding.ok:
                    key = ("conversion", name)
                    self.failures[key] = self.failures.get(key, 0) + 1
        return list(by_package.values())

    # ---- the platform's own files ----
    def check_platform(self) -> Finding:
        """Re-hash the platform's installed files against its wheel's ``RECORD``."""
        try:
            dist = metadata.distribution(PLATFORM_DIST)
        except metadata.PackageNotFoundError:
            return Finding("platform", PLATFORM_DIST, ["not installed as a distribution"])
        checked, problems = 0, []
        for entry in dist.files or []:
            if entry.hash is None or entry.hash.mode != "sha256":
                continue
            path = Path(str(entry.locate()))
            try:
                digest = hashlib.file_digest(path.open("rb"), "sha256").digest()
            except OSError as exc:
                problems.append(f"{entry}: {exc.strerror or 'unreadable'}")
                continue
            checked += 1
            wanted = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4))
            if digest != wanted:
                problems.append(f"{entry}: content differs from the wheel's RECORD")
        finding = Finding("platform", PLATFORM_DIST, problems)
        if checked == 0 and not problems:
            if not self._said_not_checkable:
                self._said_not_checkable = True
                self.audit.write(
                    "not_checkable",
                    kind="platform",
                    reason="an editable (development) install: its RECORD lists no source files",
                )
            return finding
        self._count(finding)
        return finding

    # ---- the sweep ----
    def sweep(self, serving: dict[str, Path], active: Collection[str] = ()) -> list[Finding]:
        """Check the platform, each served model (alias -> model directory) that is a
        package and the sealed conversions the ``active`` workloads started from; every
        finding is audited. Returns them all (ok or not)."""
        started = time.monotonic()
        findings = [self.check_platform()]
        seen: set[str] = set()
        for path in serving.values():
            installed = self.package_of(path)
            if installed is not None and installed.path not in seen:
                seen.add(installed.path)
                findings.append(self._check_package(installed, rehash=True))
        findings += self.check_conversions(active)
        self.checks += 1
        self.last_check = time.time()
        for f in findings:
            if not f.ok:
                self.audit.write("integrity_failure", kind=f.kind, name=f.name,
                                 version=f.version, problems=f.problems)  # fmt: skip
        self.audit.write("integrity_check", ok=all(f.ok for f in findings),
                         checked=[f.name for f in findings],
                         seconds=round(time.monotonic() - started, 3))  # fmt: skip
        return findings

    def families(self) -> Iterator[Metric]:
        ok = GaugeMetricFamily(
            "kunlun_integrity_ok",
            "1 when the installed files of a package or the platform match their signed "
            "hashes at the last check (kind conversion: the weights derived from the package "
            "match their seal), 0 when not.",
            labels=["kind", "name"],
        )
        for (kind, name), good in sorted(self.status.items()):
            ok.add_metric([kind, name], 1.0 if good else 0.0)
        yield ok
        failed = CounterMetricFamily(
            "kunlun_integrity_failures",
            "Integrity checks that found a package, its derived weights or the platform changed.",
            labels=["kind", "name"],
        )
        for (kind, name), count in sorted(self.failures.items()):
            failed.add_metric([kind, name], count)
        yield failed
        yield CounterMetricFamily(
            "kunlun_integrity_checks", "Integrity sweeps run (start and every interval).",
            self.checks,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kunlun_integrity_last_check_timestamp_seconds",
            "When the last integrity sweep ran (Unix time; 0: never).",
            self.last_check,
        )


def daemon_guard(
    home: Path, config: Path | None, require_signed: bool, keys: list[Path] | None
) -> ModelGuard:
    """The daemon's :class:`~kunlun.offline.integrity.ModelGuard`. With ``require_signed``:
    the trusted keys must load, the device config's detached signature must verify and the
    platform's own installed files must match their hashes, or the daemon does not start."""
    paths = keys or [home / TRUSTED_KEYS_DIR]
    default_missing = not keys and not paths[0].is_dir()
    if not require_signed:
        try:  # packages are still checked against their signature when keys are at hand
            trusted = None if default_missing else TrustedKeys.from_paths(paths)
        except ConfigError as exc:
            if keys:
                raise
            print(f"not checking package signatures: {exc}", flush=True)
            trusted = None
        return ModelGuard(home, trusted)
    if default_missing:
        raise ConfigError(
            "--require-signed needs trusted keys; none given and no KUNLUN_HOME/trusted-keys",
            location=Location("--trusted-keys"),
        )
    guard = ModelGuard(home, TrustedKeys.from_paths(paths), require_signed=True)
    if config is not None:
        signer = verify_file(guard.trusted, config)  # type: ignore[arg-type]
        guard.audit.write("verified", kind="device_config", path=str(config), signer=signer)
    own = guard.check_platform()
    if not own.ok:
        guard.audit.write("integrity_failure", kind="platform", name=own.name,
                          problems=own.problems)  # fmt: skip
        raise IntegrityError(
            f"the platform's installed files fail their integrity check: {own.describe()}",
            hint="reinstall from the signed bundle (kunlun-installer install --bundle ...)",
        )
    guard.audit.write("started", require_signed=True, trusted=sorted(guard.trusted.keys))  # type: ignore[union-attr]
    return guard
