"""The manifest of a signed archive: a model package (``.kunlunpkg``) or the offline bundle.

Standard library only: the offline installer's bootstrap reads it before anything is
installed. A manifest is JSON, written once with sorted keys (:func:`dump`); its signature
(``manifest.sig``) covers those exact bytes, so nothing here re-serialises a manifest it read.

Fields common to both kinds:

- ``format``: :data:`PACKAGE_FORMAT` or :data:`BUNDLE_FORMAT`;
- ``name``: the model id (package) or ``kunlun-platform`` (bundle); ``version``: a positive
  integer that only increases (an installer refuses an older one than it has);
- ``created`` (UTC, ISO 8601), ``kunlun_version``, ``signer`` (the key's fingerprint);
- ``files``: every file's ``path`` (relative, ``/``-separated), ``size`` and ``sha256``,
  sorted by path; the archive holds exactly these and the two manifest members.

A package adds ``model`` (architecture, dtype, quantization, target device types, minimum
memory, licence, plan summary); a bundle adds ``bundle`` (Python, platform, wheels).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

PACKAGE_FORMAT = "kunlunpkg/1"
BUNDLE_FORMAT = "kunlun-bundle/1"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
MAX_MANIFEST_BYTES = 16 << 20
"""A larger manifest member is refused before it is parsed."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_CREATED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


class ManifestError(ValueError):
    """A manifest or a member name that cannot be accepted; the message names the field."""


def check_member_name(name: str, where: str = "member") -> str:
    """``name`` when it is a safe relative path inside the archive, else :class:`ManifestError`:
    empty, absolute, with ``..``, ``.`` or empty components, a backslash or a control
    character are all refused."""
    if not name:
        raise ManifestError(f"{where} has an empty name")
    if name.startswith("/"):
        raise ManifestError(f"{where} {name!r} is an absolute path")
    if "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ManifestError(f"{where} {name!r} has a backslash or a control character")
    parts = name.split("/")
    if ".." in parts:
        raise ManifestError(f"{where} {name!r} climbs out of the directory ('..')")
    if any(p in ("", ".") for p in parts):
        raise ManifestError(f"{where} {name!r} has an empty or '.' component")
    return name


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass
class Manifest:
    format: str
    name: str
    version: int
    created: str
    kunlun_version: str
    signer: str
    files: list[FileEntry]
    extra: dict[str, Any] = field(default_factory=dict)
    """The kind's own section: ``{"model": {...}}`` or ``{"bundle": {...}}``."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "name": self.name,
            "version": self.version,
            "created": self.created,
            "kunlun_version": self.kunlun_version,
            "signer": self.signer,
            "files": [f.to_dict() for f in self.files],
            **self.extra,
        }


def dump(manifest: Manifest) -> bytes:
    """The bytes that are written and signed: sorted keys, two-space indent, final newline."""
    return (json.dumps(manifest.to_dict(), indent=2, sort_keys=True) + "\n").encode()


def parse(data: bytes, where: str = MANIFEST, expect_format: str | None = None) -> Manifest:
    """The manifest in ``data``; :class:`ManifestError` naming ``where`` and the field (or the
    line and column of a JSON error) for anything malformed."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where} is {len(data)} bytes, over {MAX_MANIFEST_BYTES}")
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(
            f"{where} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} must be a JSON object, got {type(raw).__name__}")

    def text(key: str, pattern: re.Pattern[str] | None = None) -> str:
        value = raw.get(key)
        if not isinstance(value, str) or not value or (pattern and not pattern.match(value)):
            raise ManifestError(f"{where}: field {key!r} is missing or invalid: {value!r}")
        return value

    fmt = text("format")
    if fmt not in (PACKAGE_FORMAT, BUNDLE_FORMAT) or (expect_format and fmt != expect_format):
        wanted = expect_format or f"{PACKAGE_FORMAT} or {BUNDLE_FORMAT}"
        raise ManifestError(f"{where}: field 'format' is {fmt!r}, expected {wanted}")
    version = raw.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ManifestError(f"{where}: field 'version' must be a positive integer: {version!r}")
    files_raw = raw.get("files")
    if not isinstance(files_raw, list):
        raise ManifestError(f"{where}: field 'files' must be a list")
    files: list[FileEntry] = []
    seen: set[str] = set()
    for i, item in enumerate(files_raw):
        at = f"{where}: files[{i}]"
        if not isinstance(item, dict):
            raise ManifestError(f"{at} must be an object")
        path, size, digest = item.get("path"), item.get("size"), item.get("sha256")
        if not isinstance(path, str):
            raise ManifestError(f"{at}.path must be a string: {path!r}")
        check_member_name(path, f"{at}.path")
        if path in (MANIFEST, SIGNATURE) or path in seen:
            raise ManifestError(f"{at}.path {path!r} is listed twice or reserved")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{at}.size must be a non-negative integer: {size!r}")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise ManifestError(f"{at}.sha256 must be 64 lowercase hex digits: {digest!r}")
        seen.add(path)
        files.append(FileEntry(path, size, digest))
    common = {"format", "name", "version", "created", "kunlun_version", "signer", "files"}
    return Manifest(
        format=fmt,
        name=text("name", _NAME),
        version=version,
        created=text("created", _CREATED),
        kunlun_version=text("kunlun_version"),
        signer=text("signer"),
        files=files,
        extra={k: v for k, v in raw.items() if k not in common},
    )
