"""The keys a home trusts for good, ``HOME/trusted-keys/*.pub``: ``kunlun-installer trust``.

Later installs, ``--repair`` and ``kunlun-platform --require-signed`` trust these keys. Trust
is explicit: the folder gets a key only from the bundle install (the key that verified the
bundle), from ``--trust-key``, from ``kunlun-installer trust add``, or, in a home that trusts
no key yet, from the first package install (the key that verified it): each is said in the
output and appended to ``HOME/logs/audit.jsonl`` (``key_trusted``); a key removed is audited
too (``key_untrusted``). A key given with ``--public-key`` is otherwise used for that one
command only.

A key is named by its fingerprint, ``SHA256:`` and the hex SHA-256 of its raw 32 bytes, read
with the pure-Python :mod:`.ed25519`; ``trust list`` shows with each key the models pinned to
it (``packages/installed.json``). Standard library only, like the bootstrap that imports it
(one of the modules of the installer zipapp, :data:`kunlun.offline.bundle.ZIPAPP_MODULES`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kunlun.errors import ConfigError, Location
from kunlun.offline import ed25519
from kunlun.offline.audit_log import audit
from kunlun.paths import INSTALLED_FILE, READ_ONLY_DIR

TRUSTED_KEYS_DIR = "trusted-keys"
REGISTRY_FILE = f"{READ_ONLY_DIR}/{INSTALLED_FILE}"
"""The installed packages and each model's pinned signer (:mod:`kunlun.offline.registry`)."""


def key_fingerprint(path: Path) -> str:
    """``SHA256:`` and the hex SHA-256 of the raw key in the PEM file ``path`` (the
    fingerprint manifests and ``cryptography``'s side use); :class:`ConfigError` otherwise."""
    try:
        raw = ed25519.public_key_from_pem(path.read_bytes())
    except (OSError, ValueError) as exc:
        text = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ConfigError(
            f"not an Ed25519 public key: {text}", location=Location(str(path))
        ) from None
    return "SHA256:" + hashlib.sha256(raw).hexdigest()


def trusted_key_files(home: Path) -> dict[str, list[Path]]:
    """The keys ``HOME/trusted-keys`` holds (its ``*.pub``), by fingerprint; a file that is
    not an Ed25519 public key is a :class:`ConfigError`, as when the daemon loads them."""
    folder = home / TRUSTED_KEYS_DIR
    found: dict[str, list[Path]] = {}
    if folder.is_dir():
        for path in sorted(folder.glob("*.pub")):
            found.setdefault(key_fingerprint(path), []).append(path)
    return found


def trust_key(home: Path, path: Path, reason: str) -> tuple[str, Path, bool]:
    """Record the public key ``path`` as trusted in ``HOME/trusted-keys`` (what later installs,
    ``--repair`` and ``kunlun-platform --require-signed`` trust); returns its fingerprint, the
    file and whether it was new. A new key is appended to the audit log with ``reason``."""
    fp = key_fingerprint(path)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder = home / TRUSTED_KEYS_DIR
    folder.mkdir(exist_ok=True, mode=0o700)
    already = trusted_key_files(home).get(fp)
    if already:
        return fp, already[0], False
    target = folder / (fp.removeprefix("SHA256:")[:16] + ".pub")
    temporary = folder / f".{target.name}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(path.read_bytes())
    os.replace(temporary, target)
    audit(home, "key_trusted", fingerprint=fp, file=str(target), reason=reason)
    return fp, target, True


def trust_line(home: Path, path: Path, reason: str) -> str:
    """:func:`trust_key`, as the line an install prints."""
    fp, file, new = trust_key(home, path, reason)
    if not new:
        return f"key {fp} is trusted already ({file})"
    return f"trusted key {fp} ({reason}): recorded in {file}"


def pinned_models(home: Path) -> dict[str, list[str]]:
    """Each signer's fingerprint and the models pinned to it (``installed.json``)."""
    try:
        raw = json.loads((home / REGISTRY_FILE).read_text(encoding="utf-8"))
        signers = dict(raw.get("signers") or {})
        for name, active in (raw.get("active") or {}).items():
            signers.setdefault(name, active["signer"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}
    models: dict[str, list[str]] = {}
    for name, fp in sorted(signers.items()):
        models.setdefault(str(fp), []).append(str(name))
    return models


def untrust_key(home: Path, which: str) -> tuple[str, list[Path]]:
    """Remove a key from ``HOME/trusted-keys``: ``which`` is its ``.pub`` file or its
    fingerprint (``SHA256:`` optional, at least 16 hex digits, matching one key only)."""
    keys = trusted_key_files(home)
    where = Location(which)
    if Path(which).is_file():
        fp = key_fingerprint(Path(which))
        if fp not in keys:
            raise ConfigError(f"key {fp} is not trusted here ({home / TRUSTED_KEYS_DIR})",
                              location=where)  # fmt: skip
    else:
        digits = which.removeprefix("SHA256:").lower()
        if len(digits) < 16 or any(c not in "0123456789abcdef" for c in digits):
            raise ConfigError(
                "give the key's .pub file or its fingerprint (SHA256: and at least 16 hex "
                "digits; kunlun-installer trust list shows them)",
                location=where,
            )
        found = [fp for fp in keys if fp.removeprefix("SHA256:").startswith(digits)]
        if len(found) != 1:
            what = "no trusted key has" if not found else f"{len(found)} trusted keys have"
            raise ConfigError(f"{what} this fingerprint", location=where)
        fp = found[0]
    for path in keys[fp]:
        path.unlink()
    audit(home, "key_untrusted", fingerprint=fp, files=[str(p) for p in keys[fp]])
    return fp, keys[fp]


def trust_command(home: Path, action: str, key: str | None) -> int:
    """``kunlun-installer trust add KEY | list | remove KEY``."""
    if action == "add":
        assert key is not None
        print(trust_line(home, Path(key), "trust add"))
        return 0
    if action == "remove":
        assert key is not None
        fp, files = untrust_key(home, key)
        print(f"removed trusted key {fp} ({', '.join(str(p) for p in files)})")
        pinned = pinned_models(home).get(fp)
        if pinned:
            print(f"models pinned to it: {', '.join(pinned)}; kunlun-platform --require-signed "
                  "no longer serves them; --repair and their new versions need the key given with "
                  "--public-key")  # fmt: skip
        return 0
    by_signer = pinned_models(home)
    rows = [{"fingerprint": fp, "files": [str(p) for p in paths], "models": by_signer.get(fp, [])}
            for fp, paths in trusted_key_files(home).items()]  # fmt: skip
    print(json.dumps(rows, indent=2))
    return 0
