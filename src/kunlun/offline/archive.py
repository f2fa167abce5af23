"""Signed archives on disk: written reproducibly, read defensively.

Standard library only (the offline installer's bootstrap uses it). An archive is a POSIX tar
whose first two members are ``manifest.json`` and ``manifest.sig`` (:mod:`.manifest`),
followed by exactly the files the manifest lists, in its order.

:func:`write_archive` makes the same bytes from the same inputs: members in manifest order,
regular files only, mode 0644, owner 0:0 with no names, one fixed modification time.

:class:`ArchiveReader` trusts nothing it reads. Before any file data it checks the first two
members, and the caller checks the signature and the :class:`Limits` (members, total size,
expansion over the archive's own size: a tar bomb is refused from its signed sizes before a
byte is unpacked). Then each member must be a regular file, with a safe name, listed in the
manifest once, of the listed size, with the listed SHA-256; links, devices, setuid bits,
extra and missing files and a truncated archive are each an :class:`ArchiveError` naming the
member. Compressed archives (gzip, bzip2, xz) are read too.

No header is read whole before it is checked: every raw 512-byte header goes through
:class:`_GuardedTarInfo` before :mod:`tarfile` reads what it announces. The archive's first
header must be ``manifest.json`` itself (no extended header before it), and an extended
header later (PAX ``x``/``g``, Solaris ``X``, GNU long name ``L``/``K``) may hold at most
:data:`MAX_EXTENDED_HEADER_BYTES`, at most :data:`MAX_EXTENDED_HEADERS` of them in a row:
:mod:`tarfile` would read a 1.5 GiB PAX header into memory (and, compressed, from a 1.5 MB
file) before any limit of ours could look at it.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from kunlun.errors import Location, PackageError
from kunlun.offline.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SIGNATURE,
    FileEntry,
    Manifest,
    ManifestError,
    check_member_name,
)

CHUNK = 1 << 20
MAX_SIGNATURE_BYTES = 4096
MAX_EXTENDED_HEADER_BYTES = 8 << 10
"""The largest extended header (a long name, a PAX record set) accepted: 8 KiB."""
MAX_EXTENDED_HEADERS = 4
"""The most extended headers in a row before one member."""
EXTENDED_HEADERS = {
    tarfile.XHDTYPE: "PAX extended header (tar type 'x')",
    tarfile.XGLTYPE: "PAX global header (tar type 'g')",
    tarfile.SOLARIS_XHDTYPE: "Solaris extended header (tar type 'X')",
    tarfile.GNUTYPE_LONGNAME: "GNU long name header (tar type 'L')",
    tarfile.GNUTYPE_LONGLINK: "GNU long link header (tar type 'K')",
}


class ArchiveError(ValueError):
    """An archive that cannot be accepted; the message names the member and the cause."""


class _HeaderRefused(ArchiveError):
    """A raw tar header refused before :mod:`tarfile` reads what it announces (not a
    ``tarfile.ReadError``: ``tarfile.open`` would then try the next compression)."""


class _GuardedTarInfo(tarfile.TarInfo):
    """A :class:`tarfile.TarInfo` that checks each raw header (parsed from its 512 bytes,
    nothing after them read yet) before :mod:`tarfile` processes it."""

    def _proc_member(self, archive: tarfile.TarFile) -> tarfile.TarInfo:
        kind = EXTENDED_HEADERS.get(self.type)
        at = f"the header at byte {self.offset}"
        if self.offset == 0 and kind is not None:
            raise _HeaderRefused(
                f"its first header is a {kind} of {self.size} bytes; nothing may come before "
                f"{MANIFEST}, the first member"
            )
        if self.size < 0:
            raise _HeaderRefused(f"{at} declares a negative size ({self.size})")
        chain = 0
        if kind is not None:
            if self.size > MAX_EXTENDED_HEADER_BYTES:
                raise _HeaderRefused(
                    f"{at} is a {kind} of {self.size} bytes, over the limit of "
                    f"{MAX_EXTENDED_HEADER_BYTES} bytes"
                )
            chain = getattr(archive, "_kunlun_extended_in_a_row", 0) + 1
            if chain > MAX_EXTENDED_HEADERS:
                raise _HeaderRefused(
                    f"{at} is a {kind}, more than {MAX_EXTENDED_HEADERS} extended headers in a row"
                )
        archive._kunlun_extended_in_a_row = chain  # type: ignore[attr-defined]
        return tarfile.TarInfo._proc_member(self, archive)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Limits:
    """What an archive may unpack to; checked from the signed manifest before any data."""

    max_members: int = 100_000
    max_total_bytes: int = 2 << 40
    """2 TiB of files in all."""
    max_ratio: float = 100.0
    """Unpacked bytes per byte of archive: weights barely compress, a bomb compresses 1000x."""

    def check(self, manifest: Manifest, archive_bytes: int) -> None:
        if len(manifest.files) > self.max_members:
            raise ArchiveError(
                f"{len(manifest.files)} files, over the limit of {self.max_members} members"
            )
        total = manifest.total_bytes
        if total > self.max_total_bytes:
            raise ArchiveError(
                f"unpacks to {total} bytes, over the limit of {self.max_total_bytes} bytes"
            )
        ratio = total / max(archive_bytes, 1)
        if ratio > self.max_ratio:
            raise ArchiveError(
                f"unpacks to {total} bytes from {archive_bytes}: a compression ratio of "
                f"{ratio:.0f}x, over the limit of {self.max_ratio:.0f}x (a tar bomb?)"
            )


def refused(exc: ValueError, path: Path) -> PackageError:
    """``exc`` (an :class:`ArchiveError` or a ``ManifestError``) as the
    :class:`~kunlun.errors.PackageError` a command exits with (status 3): one line, naming
    ``path`` once (the message names it already, or it is given as the location)."""
    message = " ".join(str(exc).splitlines())
    if message.startswith(str(path)):
        return PackageError(message)
    return PackageError(message, location=Location(str(path)))


def _tarinfo(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = mtime
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def write_archive(
    out: Path,
    manifest_bytes: bytes,
    signature: bytes,
    files: list[tuple[FileEntry, Path]],
    mtime: int,
) -> None:
    """Write the archive to ``out`` (through a temporary sibling renamed at the end): the
    manifest, its signature, then each ``(entry, source)`` in order, each source's bytes
    checked against its entry while it is copied."""
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        with (
            temporary.open("wb") as raw,
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for name, data in ((MANIFEST, manifest_bytes), (SIGNATURE, signature)):
                tar.addfile(_tarinfo(name, len(data), mtime), io.BytesIO(data))
            for entry, source in files:
                with source.open("rb") as handle:
                    checked = _CheckedReader(handle, entry, str(source))
                    tar.addfile(_tarinfo(entry.path, entry.size, mtime), checked)
                    checked.finish()
        os.replace(temporary, out)
    finally:
        temporary.unlink(missing_ok=True)


class _CheckedReader(io.RawIOBase):
    """Reads a source file for the tar writer and hashes what it hands out."""

    def __init__(self, handle: BinaryIO, entry: FileEntry, where: str) -> None:
        self.handle, self.entry, self.where = handle, entry, where
        self.digest = hashlib.sha256()
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.digest.update(data)
        self.count += len(data)
        return data

    def finish(self) -> None:
        if self.count != self.entry.size or self.digest.hexdigest() != self.entry.sha256:
            raise ArchiveError(f"{self.where} changed while it was packed")


def _one_line(exc: BaseException) -> str:
    """An exception's text on one line (``tarfile.open`` lists each method it tried)."""
    return " ".join(str(exc).replace("- method", "method").split())


def hash_file(path: Path) -> tuple[int, str]:
    """``(size, sha256 hex)`` of a file, streamed."""
    with path.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256")
    return path.stat().st_size, digest.hexdigest()


def stream_hash(
    source: IO[bytes], size: int, sink: Callable[[memoryview], object] | None = None
) -> tuple[int, str]:
    """Read ``size`` bytes of ``source`` in 1 MiB chunks, hash them and hand each to ``sink``;
    returns ``(bytes read, sha256 hex)`` (fewer bytes when the source ended early)."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    left = size
    while left > 0:
        n = source.readinto(view[: min(CHUNK, left)])  # type: ignore[attr-defined]
        if not n:
            break
        digest.update(view[:n])
        if sink is not None:
            sink(view[:n])
        left -= n
    return size - left, digest.hexdigest()


class ArchiveReader:
    """One pass over a signed archive: :meth:`header`, then :meth:`files`."""

    def __init__(self, path: Path, label: str = "package") -> None:
        self.path = path
        self.label = label
        self.size = path.stat().st_size
        self.manifest_bytes = self.signature = b""
        """Set by :meth:`header`."""
        try:
            self.tar = tarfile.open(  # noqa: SIM115 - closed by __exit__
                path, mode="r:*", tarinfo=_GuardedTarInfo
            )
        except _HeaderRefused as exc:
            raise ArchiveError(f"{path}: {exc}") from None
        except tarfile.ReadError as exc:
            raise ArchiveError(f"{path} is not a tar archive ({_one_line(exc)})") from None
        except (EOFError, OSError) as exc:  # compressed and cut short
            raise ArchiveError(f"{path} is truncated or damaged ({_one_line(exc)})") from None

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.tar.close()

    def _next(self) -> tarfile.TarInfo | None:
        try:
            return self.tar.next()
        except _HeaderRefused as exc:
            raise ArchiveError(f"{self.path}: {exc}") from None
        except (tarfile.ReadError, EOFError, OSError) as exc:
            raise ArchiveError(f"{self.path} is truncated or damaged ({_one_line(exc)})") from None

    def _small_member(self, expected: str, limit: int) -> bytes:
        member = self._next()
        if member is None or member.name != expected:
            found = "nothing" if member is None else repr(member.name)
            raise ArchiveError(
                f"{self.path}: the {self.label} must start with {MANIFEST} and {SIGNATURE}; "
                f"found {found} where {expected} belongs"
            )
        self._check_type(member)
        if member.size > limit:
            raise ArchiveError(f"{self.path}: {expected} is {member.size} bytes, over {limit}")
        handle = self.tar.extractfile(member)
        assert handle is not None  # a regular file
        try:
            data = handle.read()
        except (tarfile.ReadError, EOFError, OSError):
            data = b""
        if len(data) != member.size:
            raise ArchiveError(
                f"{self.path} is truncated inside {expected} (of its {member.size} bytes)"
            )
        return data

    def header(self) -> tuple[bytes, bytes]:
        """The manifest's bytes and the signature's bytes (not yet verified)."""
        self.manifest_bytes = self._small_member(MANIFEST, MAX_MANIFEST_BYTES)
        self.signature = self._small_member(SIGNATURE, MAX_SIGNATURE_BYTES)
        return self.manifest_bytes, self.signature

    def _check_type(self, member: tarfile.TarInfo) -> None:
        name = member.name
        if member.issym() or member.islnk():
            kind = "symbolic" if member.issym() else "hard"
            target = member.linkname
            leaves = target.startswith("/") or ".." in target.split("/")
            where = ", which leaves the package directory" if leaves else ""
            raise ArchiveError(
                f"{self.path}: member {name!r} is a {kind} link to {target!r}{where}; "
                f"a {self.label} holds regular files only"
            )
        if member.ischr() or member.isblk() or member.isfifo():
            raise ArchiveError(
                f"{self.path}: member {name!r} is a device or FIFO; "
                f"a {self.label} holds regular files only"
            )
        if not member.isreg() or member.type == tarfile.GNUTYPE_SPARSE or member.sparse:
            raise ArchiveError(
                f"{self.path}: member {name!r} is not a regular file (tar type "
                f"{member.type!r}); a {self.label} holds regular files only"
            )
        if member.mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
            raise ArchiveError(
                f"{self.path}: member {name!r} has setuid, setgid or sticky bits "
                f"(mode {member.mode:o})"
            )

    def files(
        self,
        manifest: Manifest,
        sink: Callable[[FileEntry], Callable[[memoryview], object]] | None = None,
    ) -> Iterator[FileEntry]:
        """Check every remaining member against ``manifest``, hashing its data (and handing
        it to ``sink(entry)``'s writer when given); yields each entry once it matched."""
        listed = manifest.by_path()
        seen: set[str] = set()
        while (member := self._next()) is not None:
            name = member.name
            try:
                check_member_name(name)
            except ManifestError as exc:
                raise ArchiveError(f"{self.path}: unsafe {exc}") from None
            self._check_type(member)
            entry = listed.get(name)
            if entry is None:
                raise ArchiveError(
                    f"{self.path}: extra file {name!r} is not in the signed manifest"
                )
            if name in seen:
                raise ArchiveError(f"{self.path}: member {name!r} appears twice")
            seen.add(name)
            if member.size != entry.size:
                raise ArchiveError(
                    f"{self.path}: member {name!r} is {member.size} bytes; the manifest "
                    f"says {entry.size}"
                )
            handle = self.tar.extractfile(member)
            assert handle is not None
            try:
                count, digest = stream_hash(handle, entry.size, sink(entry) if sink else None)
            except (tarfile.ReadError, EOFError, OSError) as exc:
                raise ArchiveError(
                    f"{self.path} is truncated or damaged inside {name!r} ({exc})"
                ) from None
            if count != entry.size:
                raise ArchiveError(
                    f"{self.path} is truncated: {name!r} has {count} of its {entry.size} bytes"
                )
            if digest != entry.sha256:
                raise ArchiveError(
                    f"{self.path}: {name!r} does not match its SHA-256 in the manifest "
                    f"(got {digest[:16]}..., signed {entry.sha256[:16]}...)"
                )
            yield entry
        missing = [f.path for f in manifest.files if f.path not in seen]
        if missing:
            raise ArchiveError(
                f"{self.path}: {len(missing)} file(s) of the manifest are missing, first "
                f"{missing[0]!r} (a truncated or incomplete {self.label})"
            )
