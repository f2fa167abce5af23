"""Property-based fuzzing of what a package file feeds the platform before any signature is
checked (issue 32, "close the class"): its manifest's JSON and its raw tar headers. Whatever
the bytes, reading them ends in the package error the CLI reports as exit 3
(:class:`ManifestError` / :class:`ArchiveError`), never another exception, a hang or
unbounded memory. Bounded in cases for CI; ``KUNLUN_FUZZ_EXAMPLES`` makes a longer run.
The end-to-end refusals of each known hostile package are in ``test_hostile_packages.py``.
"""

from __future__ import annotations

import gzip as gzip_module
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kunlun.offline.archive import ArchiveError, ArchiveReader
from kunlun.offline.manifest import ManifestError, parse

EXAMPLES = 40 * int(os.environ.get("KUNLUN_FUZZ_EXAMPLES", "6"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))  # fmt: skip

LEAVES = (
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30)
    | st.sampled_from(["2024-13-45T25:61:61Z", "2024-01-01T00:00:00Z\n", "tiny\n", "9" * 5000,
                       "kunlunpkg/1", "../../etc/passwd", "/abs", "a/./b"])
)  # fmt: skip
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["format", "name", "version", "created", "files", "model",
                                       "size", "sha256", "path", "signer", "kunlun_version"])
                      | st.text(max_size=8), inner, max_size=6),
    max_leaves=20,
)  # fmt: skip


def manifest_like(draw: st.DrawFn) -> bytes:
    """A manifest that is nearly right (a real shape with one part changed) or anything."""
    base: dict[str, Any] = {
        "format": "kunlunpkg/1", "name": "tiny", "version": 1,
        "created": "2026-01-01T00:00:00Z", "kunlun_version": "0.1", "signer": "x",
        "model": {}, "files": [{"path": "model/config.json", "size": 2, "sha256": "0" * 64}],
    }  # fmt: skip
    if draw(st.booleans()):
        for key in draw(st.lists(st.sampled_from(sorted(base)), max_size=3, unique=True)):
            base[key] = draw(VALUES)
        return json.dumps(base).encode()
    raw = json.dumps(draw(VALUES)).encode()
    return draw(st.sampled_from([raw, raw[: len(raw) // 2], b"[" * 100_000, b"\xff" + raw]))


@FUZZ
@given(st.composite(manifest_like)())
def test_any_manifest_bytes_end_in_a_manifest_error_or_a_manifest(data: bytes) -> None:
    try:
        parse(data)
    except ManifestError as exc:
        assert str(exc) and len(str(exc)) < 2000
    # anything else raised fails the test


HEADER_TYPES = st.sampled_from([b"0", b"5", b"x", b"g", b"L", b"K", b"X", b"S", b"2", b"1"])


def raw_header(name: bytes, size_field: bytes, kind: bytes) -> bytes:
    """One 512-byte tar header with a valid checksum for whatever it says."""
    block = bytearray(512)
    block[0 : len(name[:100])] = name[:100]
    block[100:108] = b"0000644\0"
    block[124:136] = size_field[:12].ljust(12, b"\0")
    block[156:157] = kind
    block[257:263] = b"ustar\0"
    block[263:265] = b"00"
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


SIZE_FIELDS = st.one_of(
    st.integers(0, 8**11 - 1).map(lambda n: b"%011o\0" % n),
    st.integers(0, 2**88 - 1).map(lambda n: b"\x80" + n.to_bytes(11, "big")),  # base-256
    st.binary(min_size=12, max_size=12),
)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from([b"manifest.json", b"manifest.sig", b"model/x",
                                           b"././@PaxHeader", b"a" * 100]),
                          SIZE_FIELDS, HEADER_TYPES, st.binary(max_size=1500)),
                min_size=1, max_size=5),
       st.booleans())  # fmt: skip
def test_any_tar_headers_end_in_an_archive_error_before_the_manifest_is_trusted(
    tmp_path_factory: pytest.TempPathFactory, members: list[tuple], gzip: bool
) -> None:
    blob = (
        b"".join(
            raw_header(name, size, kind) + body + b"\0" * (-len(body) % 512)
            for name, size, kind, body in members
        )
        + b"\0" * 1024
    )
    if gzip:
        blob = gzip_module.compress(blob)
    path: Path = tmp_path_factory.mktemp("fuzz") / "p.kunlunpkg"
    path.write_bytes(blob)
    try:
        with ArchiveReader(path) as reader:
            reader.header()
    except (ArchiveError, ManifestError) as exc:
        assert str(exc)
