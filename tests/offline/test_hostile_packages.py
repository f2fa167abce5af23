"""Hostile model packages through the real commands (``kunlun-cli model verify | inspect``,
``kunlun-installer install | --repair``): each is refused with exit status 3 and one line
naming the package and the cause, never a traceback, quickly and in little memory, and a
refused install leaves nothing behind.

- extended tar headers (PAX ``x``/``g``, GNU ``L``): none before ``manifest.json``, at most
  8 KiB later, checked from the raw header before :mod:`tarfile` reads what it announces;
- a package broken at its start (cut short, members out of order, a link, an oversized
  manifest);
- manifest values that parse but cannot be used (a month 13, a trailing newline, a
  5,000-digit version, a name ending in a newline, nesting 200,000 deep), signed by the
  trusted key so that the value checks, not the signature, refuse them.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest
from tests.offline.conftest import BIN, MODEL_FILES, member, raw_package, signed_manifest

from kunlun.offline.signing import load_private_key, sign

PEAK_LIMIT_MIB = 300
"""What a refusal may take at most: a CLI process is about 50 MiB."""
TIME_LIMIT_S = 20.0
"""Generous for a shared 2-core machine; a refusal takes about a second."""
HUGE = 3 << 29
"""1.5 GiB: what a hostile extended header declares."""

_MEASURE = (
    "import resource, subprocess, sys, time\n"
    "start = time.perf_counter()\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "seconds = time.perf_counter() - start\n"
    "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "print(f'@measured {seconds:.3f} {peak}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)
"""Runs one command and reports its wall time and peak RSS (KiB; its own children only)."""


class Measured:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        found = re.search(r"@measured ([0-9.]+) ([0-9]+)\n?\Z", proc.stderr)
        assert found, proc.stderr
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr[: found.start()]
        self.seconds = float(found.group(1))
        self.peak_mib = int(found.group(2)) / 1024

    def assert_refused(self, *expected: str) -> str:
        """Exit status 3 with exactly one line on stderr holding each of ``expected``."""
        where = f"exit {self.returncode}\n{self.stdout}\n{self.stderr}"
        assert self.returncode == 3, where
        assert "Traceback" not in self.stderr, where
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1, where
        for text in expected:
            assert text in lines[0], where
        return lines[0]


def measured(*args: str, home: Path) -> Measured:
    """A Kunlun command, run under :data:`_MEASURE`."""
    env = dict(os.environ, KUNLUN_HOME=str(home))
    env.pop("KUNLUN_ENDPOINT", None)
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(BIN / args[0]), *args[1:]],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    return Measured(proc)


def command(which: str, package: Path, keys: Path, home: Path) -> tuple[str, ...]:
    key = str(keys / "kunlun-signing.pub")
    return {
        "verify": ("kunlun-cli", "model", "verify", "--package", str(package),
                   "--public-key", key),
        "inspect": ("kunlun-cli", "model", "inspect", str(package)),  # the unsigned path
        "install": ("kunlun-installer", "install", "--home", str(home), "--package",
                    str(package), "--public-key", key),
        "repair": ("kunlun-installer", "--repair", "--home", str(home), "--package",
                   str(package), "--public-key", key),
    }[which]  # fmt: skip


def assert_nothing_unpacked(home: Path) -> None:
    packages = home / "packages"
    assert not packages.exists() or not any(packages.iterdir()), list(packages.iterdir())


# ---- raw tar pieces --------------------------------------------------------------------


def header(name: str, kind: bytes, size: int) -> bytes:
    """One raw 512-byte tar header (GNU format: base-256 when a size needs it)."""
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode = kind, size, 0o644
    return info.tobuf(format=tarfile.GNU_FORMAT)


def pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def regular(name: str, data: bytes) -> bytes:
    return header(name, tarfile.REGTYPE, len(data)) + pad(data)


def pax_records(size: int) -> bytes:
    """A PAX record set of exactly ``size`` bytes: one long ``comment``."""
    body = size - len(f"{size} comment=\n")
    return f"{size} comment=".encode() + b"A" * body + b"\n"


END = b"\0" * 1024


def signed_parts(keys: Path) -> tuple[bytes, bytes, bytes]:
    """The raw manifest and signature members of a good package, and its files."""
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", MODEL_FILES)
    files = b"".join(regular(path, data) for path, data in sorted(MODEL_FILES.items()))
    return regular("manifest.json", manifest), regular("manifest.sig", sig), files


# ---- bug 9: extended headers -----------------------------------------------------------


def _first_lying(keys: Path, kind: bytes, size: int = HUGE) -> bytes:
    """An extended header declaring ``size`` (1.5 GiB; over 8 GiB the size field is
    base-256), in a file of a few KiB."""
    manifest, sig, files = signed_parts(keys)
    return header("././@PaxHeader", kind, size) + manifest + sig + files + END


def _first_real_2mb(keys: Path) -> bytes:
    manifest, sig, files = signed_parts(keys)
    records = pax_records(2 << 20)
    return header("././@PaxHeader", tarfile.XHDTYPE, len(records)) + pad(records) + manifest + sig + files + END  # fmt: skip


def _first_gzip_256mib(keys: Path) -> bytes:
    """256 MiB of PAX records gzipped to about 1 MB: ``tarfile`` read them whole (850 MB of
    memory); the 1.5 GiB original of this bug took 4.8 GB."""
    manifest, sig, files = signed_parts(keys)
    size = 256 << 20
    records = pax_records(size)
    gz = zlib.compressobj(1, zlib.DEFLATED, 31)
    out = [gz.compress(header("././@PaxHeader", tarfile.XHDTYPE, size))]
    out += [gz.compress(records[i : i + (16 << 20)]) for i in range(0, size, 16 << 20)]
    out += [gz.compress(pad(records)[size:] + manifest + sig + files + END), gz.flush()]
    return b"".join(out)


FIRST_HEADER_CASES = {
    "pax-x-lying-1.5GiB": (
        lambda k: _first_lying(k, tarfile.XHDTYPE),
        "PAX extended header (tar type 'x') of 1610612736 bytes",
    ),  # fmt: skip
    "pax-g-lying-1.5GiB": (
        lambda k: _first_lying(k, tarfile.XGLTYPE),
        "PAX global header (tar type 'g') of 1610612736 bytes",
    ),  # fmt: skip
    "gnu-L-lying-1.5GiB": (
        lambda k: _first_lying(k, tarfile.GNUTYPE_LONGNAME),
        "GNU long name header (tar type 'L') of 1610612736 bytes",
    ),  # fmt: skip
    "pax-x-lying-1TiB-base-256": (
        lambda k: _first_lying(k, tarfile.XHDTYPE, 1 << 40),
        "PAX extended header (tar type 'x') of 1099511627776 bytes",
    ),  # fmt: skip
    "pax-x-real-2MiB": (_first_real_2mb, "PAX extended header (tar type 'x') of 2097152 bytes"),
    "pax-x-gzip-256MiB": (
        _first_gzip_256mib,
        "PAX extended header (tar type 'x') of 268435456 bytes",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(FIRST_HEADER_CASES))
def test_an_extended_header_before_the_manifest_is_refused_from_its_raw_header(
    keys: Path, tmp_path: Path, case: str
) -> None:
    build, named = FIRST_HEADER_CASES[case]
    package = tmp_path / "p.kunlunpkg"
    package.write_bytes(build(keys))
    for which in ("inspect", "verify", "install"):
        home = tmp_path / f"home-{which}"
        done = measured(*command(which, package, keys, home), home=home)
        line = done.assert_refused(str(package), named, "nothing may come before manifest.json")
        assert done.seconds < TIME_LIMIT_S, (which, done.seconds, line)
        assert done.peak_mib < PEAK_LIMIT_MIB, (which, done.peak_mib, line)
        assert_nothing_unpacked(home)


def test_an_oversized_extended_header_after_the_manifest_is_refused_before_it_is_read(
    keys: Path, tmp_path: Path
) -> None:
    manifest, sig, files = signed_parts(keys)
    at = len(manifest) + len(sig)
    records = pax_records(2 << 20)
    packages = {
        "lying": header("././@PaxHeader", tarfile.XHDTYPE, HUGE) + files,
        "real": header("././@PaxHeader", tarfile.XHDTYPE, len(records)) + pad(records) + files,
        "gnu-long-name": header("././@LongLink", tarfile.GNUTYPE_LONGNAME, HUGE) + files,
    }
    big = pax_records(256 << 20)  # and 256 MiB of records, gzipped to about 1 MB
    gz = zlib.compressobj(1, zlib.DEFLATED, 31)
    out = [gz.compress(manifest + sig + header("././@PaxHeader", tarfile.XHDTYPE, len(big)))]
    out += [gz.compress(big[i : i + (16 << 20)]) for i in range(0, len(big), 16 << 20)]
    gzipped = b"".join([*out, gz.compress(files + END), gz.flush()])
    del big
    for label, rest in {**packages, "gzip-256MiB": None}.items():
        package = tmp_path / f"{label}.kunlunpkg"
        package.write_bytes(gzipped if rest is None else manifest + sig + rest + END)
        for which in ("verify", "install"):
            home = tmp_path / f"home-{label}-{which}"
            done = measured(*command(which, package, keys, home), home=home)
            done.assert_refused(str(package), f"the header at byte {at} is a ",
                                "over the limit of 8192 bytes")  # fmt: skip
            assert done.seconds < TIME_LIMIT_S and done.peak_mib < PEAK_LIMIT_MIB, label
            assert_nothing_unpacked(home)
    # a negative size (base-256) would move tarfile backwards: refused from the header
    package = tmp_path / "negative.kunlunpkg"
    package.write_bytes(manifest + sig + header("model/config.json", tarfile.REGTYPE, -1024) + files + END)  # fmt: skip
    done = measured(*command("verify", package, keys, tmp_path), home=tmp_path)
    done.assert_refused(str(package), f"the header at byte {at} declares a negative size (-1024)")
    # a chain of small PAX headers (tarfile recurses once per header) is refused too
    small = pad(pax_records(100))
    chain = (header("././@PaxHeader", tarfile.XHDTYPE, 100) + small) * 5000
    package = tmp_path / "chain.kunlunpkg"
    package.write_bytes(manifest + sig + chain + files + END)
    done = measured(*command("verify", package, keys, tmp_path), home=tmp_path)
    done.assert_refused(str(package), "more than 4 extended headers in a row")


def test_a_small_pax_header_for_a_long_name_is_still_accepted(keys: Path, tmp_path: Path) -> None:
    """What ``tarfile`` writes for a name over 100 characters: a PAX header of a few bytes."""
    long_name = "model/" + "n" * 150 + ".json"
    files = {**MODEL_FILES, long_name: b"{}"}
    manifest, sig = signed_manifest(keys / "kunlun-signing.key", files)
    package = tmp_path / "p.kunlunpkg"
    with tarfile.open(package, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("manifest.json", manifest), ("manifest.sig", sig), *sorted(files.items())):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(package) as tar:  # the long name did get its own PAX header
        assert tar.getmember(long_name).pax_headers.get("path") == long_name
    done = measured(*command("verify", package, keys, tmp_path), home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "OK tiny version 1" in done.stdout


# ---- bug 10: broken at the start -------------------------------------------------------


def _cut_inside(keys: Path, which: int) -> bytes:
    manifest, sig, files = signed_parts(keys)
    if which == 0:  # half of manifest.json's data
        return manifest[: 512 + (len(manifest) - 512) // 2]
    return manifest + sig[: 512 + 40]


def _not_first(keys: Path) -> bytes:
    manifest, sig, files = signed_parts(keys)
    return sig + manifest + files + END


def _no_signature(keys: Path) -> bytes:
    manifest, sig, files = signed_parts(keys)
    return manifest + files + END


def _manifest_a_symlink(keys: Path) -> bytes:
    info = tarfile.TarInfo("manifest.json")
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    manifest, sig, files = signed_parts(keys)
    return info.tobuf(format=tarfile.GNU_FORMAT) + sig + files + END


def _manifest_over_16mib(keys: Path) -> bytes:
    manifest, sig, files = signed_parts(keys)
    big = b"{" + b" " * (16 << 20) + b"}"
    return regular("manifest.json", big) + sig + files + END


BROKEN_START = {
    "cut-inside-manifest.json": (lambda k: _cut_inside(k, 0), "is truncated inside manifest.json"),
    "cut-inside-manifest.sig": (lambda k: _cut_inside(k, 1), "is truncated inside manifest.sig"),
    "manifest.json-not-first": (_not_first, "found 'manifest.sig' where manifest.json belongs"),
    "no-manifest.sig": (_no_signature, "found 'model/config.json' where manifest.sig belongs"),
    "manifest.json-a-symlink": (
        _manifest_a_symlink,
        "member 'manifest.json' is a symbolic link to '/etc/passwd'",
    ),  # fmt: skip
    "manifest-over-16MiB": (_manifest_over_16mib, "manifest.json is 16777218 bytes, over 16777216"),
}


@pytest.mark.parametrize("which", ["verify", "inspect", "install", "repair"])
@pytest.mark.parametrize("case", list(BROKEN_START))
def test_a_package_broken_at_its_start_is_refused_with_one_line(
    keys: Path, tmp_path: Path, case: str, which: str
) -> None:
    build, expected = BROKEN_START[case]
    package = tmp_path / "p.kunlunpkg"
    package.write_bytes(build(keys))
    home = tmp_path / "home"
    done = measured(*command(which, package, keys, home), home=home)
    done.assert_refused(str(package), expected)
    assert_nothing_unpacked(home)


# ---- bug 11: values that parse but cannot be used --------------------------------------

DEEP = b"[" * 200_000 + b"]" * 200_000
BAD_VALUES = {
    "created-month-13": (b'"created": "2026-12-01T00:00:00Z"', b'"created": "2024-13-45T25:61:61Z"',
                         ("field 'created'", "'2024-13-45T25:61:61Z' is no such time")),
    "created-trailing-newline": (b'"created": "2026-12-01T00:00:00Z"',
                                 b'"created": "2026-12-01T00:00:00Z\\n"',
                                 ("field 'created'", "'2026-12-01T00:00:00Z\\n'")),
    "version-5000-digits": (b'"version": 1', b'"version": ' + b"7" * 5000,
                            ("field 'version'", "77777777777777777777... (an integer of 5000 digits)")),
    "version-10**30": (b'"version": 1', b'"version": ' + str(10**30).encode(),
                       ("field 'version'", "10000000000000000000... (an integer of 31 digits)")),
    "name-trailing-newline": (b'"name": "tiny"', b'"name": "tiny\\n"',
                              ("field 'name'", "'tiny\\n'")),
    "nested-200000-deep": (b'"model": {}', b'"model": {"deep": ' + DEEP + b"}",
                           ("manifest.json nests arrays and objects more than 64 levels deep",)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_signed_manifest_value_that_cannot_be_used_is_refused_alike_everywhere(
    keys: Path, tmp_path: Path, case: str
) -> None:
    old, new, expected = BAD_VALUES[case]
    manifest, _ = signed_manifest(keys / "kunlun-signing.key", MODEL_FILES)
    assert manifest.count(old) == 1
    manifest = manifest.replace(old, new)
    signature = sign(load_private_key(keys / "kunlun-signing.key"), manifest)  # trusted
    members = [member(path, data) for path, data in sorted(MODEL_FILES.items())]
    package = raw_package(tmp_path / "p.kunlunpkg", manifest, signature, members)
    for which in ("verify", "inspect", "install"):
        home = tmp_path / f"home-{which}"
        done = measured(*command(which, package, keys, home), home=home)
        line = done.assert_refused(f"{package}:manifest.json", *expected)
        assert len(line) < 400, line  # the value is shortened
        assert_nothing_unpacked(home)
    if case == "name-trailing-newline":  # installed, it was a second alias listed as "tiny"
        home = tmp_path / "home-install"
        listed = measured("kunlun-cli", "model", "list", "--json", home=home)
        aliases = [m["alias"] for m in json.loads(listed.stdout)]
        assert not [a for a in aliases if a.startswith("tiny")], aliases
