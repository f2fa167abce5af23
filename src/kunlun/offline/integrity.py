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

This is as far as userspace goes: it detects changed files, not a process or kernel already
subverted.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kunlun.errors import ConfigError, KunlunError, Location, PermissionDenied
from kunlun.offline.bootstrap import TRUSTED_KEYS_DIR
from kunlun.offline.install import InstalledPackage, Registry, check_installed
from kunlun.offline.signing import TrustedKeys, verify_file

AUDIT_FILE = Path("logs") / "audit.jsonl"
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
    """``package`` or ``platform``."""
    name: str
    problems: list[str]
    version: int | None = None

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
    def sweep(self, serving: dict[str, Path]) -> list[Finding]:
        """Check the platform and each served model (alias -> model directory) that is a
        package; every finding is audited. Returns them all (ok or not)."""
        started = time.monotonic()
        findings = [self.check_platform()]
        seen: set[str] = set()
        for path in serving.values():
            installed = self.package_of(path)
            if installed is not None and installed.path not in seen:
                seen.add(installed.path)
                findings.append(self._check_package(installed, rehash=True))
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
            "hashes at the last check, 0 when not.",
            labels=["kind", "name"],
        )
        for (kind, name), good in sorted(self.status.items()):
            ok.add_metric([kind, name], 1.0 if good else 0.0)
        yield ok
        failed = CounterMetricFamily(
            "kunlun_integrity_failures",
            "Integrity checks that found a package or the platform changed.",
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
