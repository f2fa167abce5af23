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
weights derived from it in the plan cache: unsigned files, so with ``--require-signed`` the
daemon seals them (:mod:`.seals`: what a seal records and where). When the worker that made
them is ready, :meth:`ModelGuard.seal` checks them against the SHA-256 the conversion took as
it wrote them, makes them read-only, writes their seal and keeps it in memory.
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

import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import Metric

from kunlun.errors import ConfigError, KunlunError, Location, PermissionDenied
from kunlun.offline.audit_log import AUDIT_FILE, AuditLog
from kunlun.offline.damage import check_installed
from kunlun.offline.integrity_metrics import integrity_families
from kunlun.offline.platform_record import PLATFORM_DIST, record_problems
from kunlun.offline.registry import InstalledPackage, Registry
from kunlun.offline.seals import (
    Conversion,
    compare_files,
    derived_files,
    discard,
    in_home,
    made_problems,
    make_read_only,
    read_seal,
    seal_changed,
    write_seal,
)
from kunlun.offline.signing import TrustedKeys, verify_file
from kunlun.offline.trust import TRUSTED_KEYS_DIR
from kunlun.planner.cache import artifacts

DEFAULT_INTERVAL_S = 300.0


class IntegrityError(KunlunError):
    """The platform's own installed files do not match their hashes: the daemon does not start."""

    code = "daemon.integrity"
    exit_code = 2


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
        key, where = entry.name, in_home(self.home, entry)
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
                sealed, why = read_seal(self.home, key, installed)
                if sealed is None:
                    self.audit.write("discarded", kind="conversion", name=installed.name,
                                     version=installed.version, key=key, model=name,
                                     path=where, reason=why)  # fmt: skip
                    self._remove(entry, name)
                    return f"integrity: {where} discarded ({why}); converting it again"
                conversion.files = sealed
            started = time.monotonic()
            problems = seal_changed(self.home, conversion)
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
        problems = made_problems(entry, found, Path(installed.path), in_home(self.home, entry))
        seconds = round(time.monotonic() - started, 3)
        if problems:  # its workloads stop; the next start converts it again
            self._tampered(conversion, problems, None, seconds)
            try:
                discard(entry)
            except OSError as exc:
                problems.append(str(exc))
            return problems
        try:
            make_read_only(entry)
            write_seal(self.home, conversion, found)
        except OSError as exc:  # not sealed: the next start discards it and converts again
            self.audit.write("not_sealed", kind="conversion", name=installed.name,
                             key=conversion.key, reason=str(exc))  # fmt: skip
            return None
        conversion.files, conversion.problems = found, []
        self._conversion_status(installed.name)
        self.audit.write("sealed", kind="conversion", name=installed.name,
                         version=installed.version, key=conversion.key,
                         path=in_home(self.home, entry), files=len(found),
                         seconds=seconds)  # fmt: skip
        return None

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
                         path=in_home(self.home, conversion.entry), problems=problems,
                         seconds=seconds)  # fmt: skip

    def _remove(self, entry: Path, name: str) -> None:
        """Discard ``entry``'s artifacts before a replica starts: the worker converts again."""
        conversion = self.conversions[entry.name]
        conversion.files = None  # the problems stay (metric 0) until it is sealed again
        try:
            discard(entry)
        except OSError as exc:
            reason = f"cannot discard the conversion {in_home(self.home, entry)}: {exc}"
            self.audit.write("refused", model=name, reason=reason)
            raise PermissionDenied(reason, location=Location(str(entry))) from exc

    def _line(self, where: str, problems: list[str]) -> str:
        return (f"integrity: {where} tampered: {'; '.join(problems)}; discarded, converting "
                "it again from the signed package")  # fmt: skip

    def _conversion_status(self, package: str) -> None:
        bad = any(c.problems for c in self.conversions.values() if c.package.name == package)
        self.status[("conversion", package)] = not bad

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
                problems = seal_changed(self.home, conversion)
                problems += compare_files(conversion.files, derived_files(conversion.entry),
                                          in_home(self.home, conversion.entry))  # fmt: skip
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
        found = record_problems(PLATFORM_DIST)
        if found is None:
            return Finding("platform", PLATFORM_DIST, ["not installed as a distribution"])
        checked, problems = found
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
        """The integrity metrics of ``/metrics`` (:mod:`.integrity_metrics`)."""
        yield from integrity_families(self.status, self.failures, self.checks, self.last_check)


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
