"""``kunlun-cli model verify`` against ``sha256sum`` over the same bytes, side by side.

One run: a signed package of ``--size-mb`` MiB of random weights in ``--files`` shards (the
shape of a real model's safetensors) is written to a temporary directory and read once so
both sides read from the page cache. Then, round after round with alternating order, the
package is verified (:func:`kunlun.offline.package.verify`: the signature, then every
member's SHA-256, streamed) and ``sha256sum`` hashes the shards. Each round gives the ratio
sha256sum time / verify time (above 1: verify is faster); the figure is the median over the
rounds. Also reports whether the CPU has SHA extensions (``sha_ni``), and, where ``openssl``
is installed, ``openssl dgst -sha256`` over the same shards in the same rounds (the hashing
library Python's ``hashlib`` uses, without the archive reading around it).

Usage: ``python benchmarks/verify.py [--size-mb 1024] [--files 4] [--rounds 7]``; prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from kunlun.offline.archive import hash_file, write_archive  # noqa: E402
from kunlun.offline.manifest import PACKAGE_FORMAT, FileEntry, Manifest, dump  # noqa: E402
from kunlun.offline.package import verify  # noqa: E402
from kunlun.offline.signing import (  # noqa: E402
    PUBLIC_FILE,
    TrustedKeys,
    fingerprint,
    generate_keys,
    load_private_key,
    sign,
)
from serving import cpu_steal_ticks  # noqa: E402

OPENSSL = shutil.which("openssl")


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def make_package(root: Path, size_mb: int, files: int) -> tuple[Path, list[Path], TrustedKeys]:
    private, public = generate_keys(root / "keys")
    key = load_private_key(private)
    shards = []
    for i in range(files):
        shard = root / f"model-{i:05d}-of-{files:05d}.safetensors"
        with shard.open("wb") as handle:
            for _ in range(size_mb // files):
                handle.write(os.urandom(1 << 20))
        shards.append(shard)
    entries = [(FileEntry(f"model/{p.name}", *hash_file(p)), p) for p in shards]
    manifest = Manifest(PACKAGE_FORMAT, "bench", 1, "2026-12-02T00:00:00Z", "0.1.0",
                        fingerprint(key.public_key()), [e for e, _ in entries],
                        {"model": {}})  # fmt: skip
    data = dump(manifest)
    package = root / "bench.kunlunpkg"
    write_archive(package, data, sign(key, data), entries, 0)
    return package, shards, TrustedKeys.from_paths([root / "keys" / PUBLIC_FILE])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kunlun-verify-bench-") as scratch:
        package, shards, trusted = make_package(Path(scratch), args.size_mb, args.files)
        verify(package, trusted)  # warm: both sides read from the page cache
        subprocess.run(["sha256sum", *map(str, shards)], check=True, capture_output=True)
        steal_start = cpu_steal_ticks()
        rounds = []
        for i in range(args.rounds):
            times: dict[str, float] = {}
            sides = ["verify", "sha256sum", *(["openssl"] if OPENSSL else [])]
            for side in sides if i % 2 == 0 else reversed(sides):
                started = time.perf_counter()
                if side == "verify":
                    report = verify(package, trusted)
                else:
                    tool = ["sha256sum"] if side == "sha256sum" else [OPENSSL, "dgst", "-sha256"]
                    subprocess.run([*tool, *map(str, shards)], check=True, capture_output=True)
                times[side] = time.perf_counter() - started
            rounds.append(times)
        steal, total = (a - b for a, b in zip(cpu_steal_ticks(), steal_start, strict=True))
    size = report.bytes
    ratios = [r["sha256sum"] / r["verify"] for r in rounds]
    print(json.dumps({
        "command": "python benchmarks/verify.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_model(),
        "sha_ni": "sha_ni" in cpu_flags(),
        "bytes": size,
        "files": args.files,
        "verify_gbps_median": round(size / statistics.median(r["verify"] for r in rounds) / 1e9, 3),
        "sha256sum_gbps_median": round(
            size / statistics.median(r["sha256sum"] for r in rounds) / 1e9, 3),
        "verify_vs_sha256sum": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        **({
            "openssl_gbps_median": round(
                size / statistics.median(r["openssl"] for r in rounds) / 1e9, 3),
            "verify_vs_openssl": round(
                statistics.median(r["openssl"] / r["verify"] for r in rounds), 3),
        } if OPENSSL else {}),
        "cpu_steal_pct": round(100 * steal / max(total, 1), 1),
        "sha256sum": subprocess.run(["sha256sum", "--version"], capture_output=True,
                                    text=True).stdout.splitlines()[0],
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
