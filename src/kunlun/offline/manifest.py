"""The manifest of a signed archive: a model package (``.kunlunpkg``) or the offline bundle.

Standard library only: the offline installer's bootstrap reads it before anything is
installed. A manifest is JSON, written once with sorted keys (:func:`dump`); its signature
(``manifest.sig``) covers those exact bytes, so nothing here re-serialises a manifest it read.

Fields common to both kinds:

- ``format``: :data:`PACKAGE_FORMAT` or :data:`BUNDLE_FORMAT`;
- ``name``: the model id (package) or ``kunlun-platform`` (bundle): 1 to 64 of
  ``A-Za-z0-9._-``, starting with a letter or digit; ``version``: an integer from 1 to
  :data:`MAX_VERSION` that only increases (an installer refuses an older one than it has);
- ``created``: UTC, exactly ``YYYY-MM-DDTHH:MM:SSZ`` and a real time;
  ``kunlun_version``, ``signer`` (the key's fingerprint): one line of at most 256 characters;
- ``files``: every file's ``path`` (relative, ``/``-separated), ``size`` and ``sha256``,
  sorted by path; the archive holds exactly these and the two manifest members. No path is
  both a file and a directory another path needs (``a`` and ``a/b``): a name/directory clash.

A package adds ``model`` (architecture, dtype, quantization, target device types, minimum
memory, licence, plan summary); a bundle adds ``bundle`` (Python, platform, wheels); either
section, when present, is an object.

:func:`parse` is the one reader of a manifest (``verify``, ``inspect``, ``install`` and
``--repair`` all use it), so what one accepts the others accept. Besides the fields, it
refuses what would crash a later step: nesting deeper than :data:`MAX_DEPTH` (Python's
parser recurses), an integer of more than 19 digits anywhere (Python refuses to convert
one of over 4,300), a value the standard library cannot use (a month 13 in ``created``).
Every refusal is a :class:`ManifestError` naming the field and its value, shortened.
"""

from __future__ import annotations

import calendar
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

PACKAGE_FORMAT = "kunlunpkg/1"
BUNDLE_FORMAT = "kunlun-bundle/1"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
MAX_MANIFEST_BYTES = 16 << 20
"""A larger manifest member is refused before it is parsed."""
MAX_DEPTH = 64
"""Deepest nesting of arrays and objects in a manifest (a packed one has 3 levels)."""
MAX_VERSION = 2**63 - 1
"""The highest ``version``: a signed 64-bit integer (the default version is the creation
time in seconds, about 2**31)."""
MAX_TEXT = 256
"""The longest ``kunlun_version`` and ``signer``."""
MAX_INT_DIGITS = 19
"""An integer literal of more digits is out of the signed 64-bit range: refused anywhere."""
CREATED_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
"""How ``created`` is written (:func:`kunlun.offline.package.iso_utc`)."""
# re.fullmatch everywhere: a "$" also matches before a final newline ("tiny\n")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_CREATED = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z")
_UNSAFE_CHAR = re.compile(r"[\x00-\x1f\x7f\\]")
"""A control character or a backslash, refused in a member name."""
_ONE_LINE = re.compile(r"[^\x00-\x1f\x7f]{1," + str(MAX_TEXT) + "}")
_SECTIONS = {PACKAGE_FORMAT: "model", BUNDLE_FORMAT: "bundle"}


class ManifestError(ValueError):
    """A manifest or a member name that cannot be accepted; the message names the field."""


class _BigInt:
    """An integer literal of more than :data:`MAX_INT_DIGITS` digits, kept as its text (not
    converted: Python refuses to convert one of over 4,300 digits, and none is usable)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_int(text: str) -> int | _BigInt:
    return _BigInt(text) if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


def shorten(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to about ``limit`` characters, saying how long it was."""
    if isinstance(value, _BigInt):
        digits = len(value.text.lstrip("-"))
        return f"{value.text[:20]}... (an integer of {digits} digits)"
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters"
    return f"{text[:limit]}... ({size})"


def created_epoch(created: object, where: str = MANIFEST) -> int:
    """``created`` (exactly :data:`CREATED_FORMAT`, a real UTC time) in seconds since the
    epoch; :class:`ManifestError` naming the field and value otherwise."""
    problem = f"{where}: field 'created' must be a UTC time written YYYY-MM-DDTHH:MM:SSZ"
    if not isinstance(created, str) or not _CREATED.fullmatch(created):
        raise ManifestError(f"{problem}: {shorten(created)}")
    try:
        when = datetime.strptime(created, CREATED_FORMAT).replace(tzinfo=UTC)
    except ValueError:  # month 13, hour 25, February 30
        raise ManifestError(f"{problem}: {shorten(created)} is no such time") from None
    return calendar.timegm(when.utctimetuple())


def _scan(value: Any) -> tuple[int, tuple[str, _BigInt] | None]:
    """The nesting depth of ``value`` (counted up to :data:`MAX_DEPTH` + 1) and its first
    :class:`_BigInt` with the path to it (``files.3.size``); without recursion."""
    depth, big = 0, None
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, level = stack.pop()
        if isinstance(item, _BigInt):
            big = big or (path, item)
            continue
        children = item.items() if isinstance(item, dict) else enumerate(item)
        depth = max(depth, level + 1)
        if depth > MAX_DEPTH:
            break
        stack.extend(
            (child, f"{path}.{key}" if path else str(key), level + 1)
            for key, child in children
            if isinstance(child, (dict, list, _BigInt))
        )
    return depth, big


def check_member_name(name: str, where: str = "member") -> str:
    """``name`` when it is a safe relative path inside the archive, else :class:`ManifestError`:
    empty, absolute, with ``..``, ``.`` or empty components, a backslash or a control
    character are all refused."""
    if not name:
        raise ManifestError(f"{where} has an empty name")
    if name.startswith("/"):
        raise ManifestError(f"{where} {shorten(name)} is an absolute path")
    if _UNSAFE_CHAR.search(name):
        raise ManifestError(f"{where} {shorten(name)} has a backslash or a control character")
    parts = name.split("/")
    if ".." in parts:
        raise ManifestError(f"{where} {shorten(name)} climbs out of the directory ('..')")
    if any(p in ("", ".") for p in parts):
        raise ManifestError(f"{where} {shorten(name)} has an empty or '.' component")
    return name


def _check_clashes(files: list[FileEntry], where: str) -> None:
    """:class:`ManifestError` when a path is listed as a file and is also a directory another
    path needs (``model/a`` and ``model/a/b``; ``manifest.json/x``): no folder can hold both."""
    needs: dict[str, str] = {}
    for entry in files:
        parts = entry.path.split("/")
        for i in range(1, len(parts)):
            needs.setdefault("/".join(parts[:i]), entry.path)
    for i, entry in enumerate(files):
        if entry.path in needs:
            raise ManifestError(
                f"{where}: files[{i}].path {shorten(entry.path)} is listed as a file, and "
                f"{shorten(needs[entry.path])} needs it to be a directory (a name/directory clash)"
            )
    for reserved in (MANIFEST, SIGNATURE):
        if reserved in needs:
            raise ManifestError(
                f"{where}: {shorten(needs[reserved])} needs {reserved!r} to be a directory, "
                "but it is the archive's own file (a name/directory clash)"
            )


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
    """The manifest in ``data``; :class:`ManifestError` naming ``where`` and the field and its
    value (or the line and column of a JSON error) for anything malformed or unusable."""
    raw, big = _load(data, where)

    def text(key: str, pattern: re.Pattern[str] | None = None) -> str:
        value = raw.get(key)
        if not isinstance(value, str) or not value or (pattern and not pattern.fullmatch(value)):
            raise ManifestError(f"{where}: field {key!r} is missing or invalid: {shorten(value)}")
        return value

    fmt = text("format")
    if fmt not in (PACKAGE_FORMAT, BUNDLE_FORMAT) or (expect_format and fmt != expect_format):
        wanted = expect_format or f"{PACKAGE_FORMAT} or {BUNDLE_FORMAT}"
        raise ManifestError(f"{where}: field 'format' is {shorten(fmt)}, expected {wanted}")
    name = text("name", _NAME)
    version = raw.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= MAX_VERSION:
        raise ManifestError(
            f"{where}: field 'version' must be an integer from 1 to {MAX_VERSION} (2**63-1): "
            f"{shorten(version)}"
        )
    created = raw.get("created")
    created_epoch(created, where)  # anything but a real time written as the packer does
    kunlun_version = text("kunlun_version", _ONE_LINE)
    signer = text("signer", _ONE_LINE)
    files = _files(raw.get("files"), where)
    _check_clashes(files, where)
    common = {"format", "name", "version", "created", "kunlun_version", "signer", "files"}
    extra = {k: v for k, v in raw.items() if k not in common}
    section = _SECTIONS[fmt]
    if section in extra and not isinstance(extra[section], dict):
        raise ManifestError(
            f"{where}: field {section!r} must be an object: {shorten(extra[section])}"
        )
    if big is not None:  # anywhere else: refused too, not kept as text
        raise ManifestError(
            f"{where}: field {big[0]!r} is an integer out of range: {shorten(big[1])}"
        )
    return Manifest(
        format=fmt,
        name=name,
        version=version,
        created=str(created),
        kunlun_version=kunlun_version,
        signer=signer,
        files=files,
        extra=extra,
    )


def _load(data: bytes, where: str) -> tuple[dict[str, Any], tuple[str, _BigInt] | None]:
    """The JSON object in ``data``, within :data:`MAX_MANIFEST_BYTES` and :data:`MAX_DEPTH`,
    and its first integer of over :data:`MAX_INT_DIGITS` digits with the path to it (None:
    none), which :func:`parse` refuses only after the fields: one in a field is named by
    that field's own check."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where} is {len(data)} bytes, over {MAX_MANIFEST_BYTES}")
    too_deep = f"{where} nests arrays and objects more than {MAX_DEPTH} levels deep"
    try:
        raw = json.loads(data.decode("utf-8"), parse_int=_parse_int)
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(
            f"{where} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:  # Python's parser recurses: a few thousand levels end here
        raise ManifestError(too_deep) from None
    depth, big = _scan(raw) if isinstance(raw, (dict, list)) else (0, None)
    if depth > MAX_DEPTH:
        raise ManifestError(too_deep)
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} must be a JSON object, got {type(raw).__name__}")
    return raw, big


def _files(files_raw: object, where: str) -> list[FileEntry]:
    """The manifest's ``files``: each an object with a safe, unreserved ``path`` listed once,
    a ``size`` from 0 to 2**63-1 and a ``sha256`` of 64 lowercase hex digits."""
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
            raise ManifestError(f"{at}.path must be a string: {shorten(path)}")
        check_member_name(path, f"{at}.path")
        if path in (MANIFEST, SIGNATURE) or path in seen:
            raise ManifestError(f"{at}.path {shorten(path)} is listed twice or reserved")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_VERSION:
            raise ManifestError(f"{at}.size must be an integer from 0 to 2**63-1: {shorten(size)}")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ManifestError(f"{at}.sha256 must be 64 lowercase hex digits: {shorten(digest)}")
        seen.add(path)
        files.append(FileEntry(path, size, digest))
    return files
