"""``kunlun-installer`` commands that run inside an installed platform (they need
``cryptography`` and the state store): ``install --package``, ``--repair`` and ``list``.

What they trust: the keys of ``HOME/trusted-keys`` and, for the one command, the keys given
with ``--public-key``. A key becomes trusted for good only explicitly (``--trust-key``,
``kunlun-installer trust add``, the bundle install) or as the first key of a home that
trusts none yet (the key that verified its first package), and the output says so."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kunlun.errors import ConfigError, Location
from kunlun.offline.install import install_package, repair
from kunlun.offline.registry import Registry
from kunlun.offline.signing import TrustedKeys
from kunlun.offline.trust import TRUSTED_KEYS_DIR, key_fingerprint, trust_line, trusted_key_files


def _store(home: Path) -> object:
    from kunlun.state.sqlite import SQLiteStore

    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    return SQLiteStore(home / "state.db")


def install_packages(
    home: Path,
    keys: Sequence[Path],
    packages: Sequence[Path],
    *,
    trust: Sequence[Path] = (),
    allow_signer_change: bool = False,
) -> int:
    """Install each package, verified with the home's trusted keys, ``keys`` (for this command
    only) and ``trust`` (recorded as trusted first). In a home that trusts no key yet, the key
    that verified the first package is recorded as trusted (the first install)."""
    anchored = bool(trusted_key_files(home))
    paths = [*keys, *trust]
    if anchored:
        paths.append(home / TRUSTED_KEYS_DIR)
    if not paths:
        raise ConfigError(
            "no trusted keys: give --public-key (this command only) or --trust-key, or trust "
            "one first (kunlun-installer trust add KEY)",
            location=Location(str(home / TRUSTED_KEYS_DIR)),
        )
    trusted = TrustedKeys.from_paths(paths)
    given = {key_fingerprint(path): path for path in [*keys, *trust]}
    for path in trust:
        print(trust_line(home, path, "--trust-key"))
    store = _store(home)
    for package in packages:
        installed, line = install_package(package, trusted, home, store,
                                          allow_signer_change=allow_signer_change)  # fmt: skip
        print(line)
        if installed.signer in trusted_key_files(home):
            continue
        key = given.get(installed.signer)
        if key is not None and not trusted_key_files(home):  # the home's first install
            print(trust_line(home, key, "it verified the first install into this home"))
            continue
        print(
            f"note: {installed.signer}, which signed {installed.name}, is trusted for this "
            "command only (--public-key); kunlun-platform --require-signed does not serve "
            f"{installed.name} until it is trusted: kunlun-installer trust add KEY"
        )
    return 0


def trusted_keys(home: Path, keys: Sequence[Path]) -> TrustedKeys:
    """The home's ``trusted-keys`` and ``keys`` (given for this command only)."""
    paths = list(keys)
    if trusted_key_files(home):
        paths.append(home / TRUSTED_KEYS_DIR)
    if not paths:
        raise ConfigError(
            "no trusted keys: give --public-key, or install with one first",
            location=Location(str(home / TRUSTED_KEYS_DIR)),
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
            continue
        what = ", ".join(f"{d['path']} ({d['problem']})" for d in r["damaged"])
        if "error" in r:
            failed += 1
            print(f"{label}: damaged: {what}; {r['error']}")
        else:
            print(f"{label}: restored {len(r['restored'])} file(s): {what}")
    if not results:
        print("no packages installed")
    return 1 if failed else 0


def list_command(home: Path) -> int:
    registry = Registry.load(home)
    trusted = trusted_key_files(home)
    rows = [
        {
            "name": p.name,
            "version": p.version,
            "path": p.path,
            "signer": p.signer,
            "pinned_signer": registry.signers.get(p.name),
            "signer_trusted": p.signer in trusted,
            "highest_version": registry.highest.get(p.name),
        }  # fmt: skip
        for p in registry.active.values()
    ]
    print(json.dumps(rows, indent=2))
    return 0
