"""``kunlun-installer`` commands that run inside an installed platform (they need
``cryptography`` and the state store): ``install --package``, ``--repair`` and ``list``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kunlun.errors import ConfigError, Location
from kunlun.offline.bootstrap import TRUSTED_KEYS_DIR, trust_keys
from kunlun.offline.install import Registry, install_package, repair
from kunlun.offline.signing import TrustedKeys


def _store(home: Path) -> object:
    from kunlun.state.sqlite import SQLiteStore

    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    return SQLiteStore(home / "state.db")


def install_packages(home: Path, keys: Sequence[Path], packages: Sequence[Path]) -> int:
    """Install each package (verified with ``keys``); the keys become trusted in ``home``."""
    trusted = TrustedKeys.from_paths(list(keys))
    store = _store(home)
    for package in packages:
        _installed, line = install_package(package, trusted, home, store)
        print(line)
    trust_keys(home, keys)
    return 0


def trusted_keys(home: Path, keys: Sequence[Path]) -> TrustedKeys:
    """``keys`` when given, else the home's ``trusted-keys`` directory."""
    paths = list(keys) or [home / TRUSTED_KEYS_DIR]
    if not keys and not paths[0].is_dir():
        raise ConfigError(
            "no trusted keys: give --public-key, or install with one first",
            location=Location(str(paths[0])),
        )
    return TrustedKeys.from_paths(paths)


def repair_command(home: Path, keys: Sequence[Path], packages: Sequence[Path]) -> int:
    """Re-verify every installed package and restore what is damaged; exit 1 if any is left."""
    from kunlun.offline.package import inspect

    by_name = {inspect(p)["name"]: p for p in packages}
    results = repair(home, trusted_keys(home, keys), by_name)
    failed = 0
    for r in results:
        label = f"{r['name']} version {r['version']}"
        if not r["damaged"]:
            print(f"{label}: intact")
        elif "error" in r:
            failed += 1
            print(f"{label}: {r['error']}")
        else:
            what = ", ".join(f"{d['path']} ({d['problem']})" for d in r["damaged"])
            print(f"{label}: restored {len(r['restored'])} file(s): {what}")
    if not results:
        print("no packages installed")
    return 1 if failed else 0


def list_command(home: Path) -> int:
    registry = Registry.load(home)
    rows = [
        {
            "name": p.name,
            "version": p.version,
            "path": p.path,
            "signer": p.signer,
            "highest_version": registry.highest.get(p.name),
        }  # fmt: skip
        for p in registry.active.values()
    ]
    print(json.dumps(rows, indent=2))
    return 0
