"""The installed-package registry, ``KUNLUN_HOME/packages/installed.json``.

For each model: its installed package (:class:`InstalledPackage`: version, install directory,
package file, signer, signed-manifest digest), the highest version ever installed (the
rollback protection of :mod:`.install`, kept across restarts) and its pinned signer, with
every ``--allow-signer-change``. The installer writes it; ``--repair``,
``kunlun-installer list`` and the daemon's integrity checks (:mod:`.integrity`) read it. An
unreadable registry is refused, never taken as empty: it holds the rollback protection.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kunlun.errors import Location, PackageError
from kunlun.offline.package import MODEL_DIR
from kunlun.paths import INSTALLED_FILE, READ_ONLY_DIR

PACKAGES_DIR = READ_ONLY_DIR
REGISTRY_FILE = INSTALLED_FILE


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
