"""Shared pieces of the offline-delivery tests: keys made by the real CLI, a tiny model packed
by the real CLI, and a builder of hand-made (bad) packages for the refusal tests."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from kunlun.offline.manifest import PACKAGE_FORMAT, FileEntry, Manifest, dump
from kunlun.offline.signing import fingerprint, load_private_key, sign

BIN = Path(sys.executable).parent


def run(*args: str, home: Path, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """A Kunlun command (``kunlun-cli ...`` or ``kunlun-installer ...``) with ``home``."""
    full = dict(os.environ, KUNLUN_HOME=str(home), **env)
    full.pop("KUNLUN_ENDPOINT", None)
    proc = subprocess.run(
        [str(BIN / args[0]), *args[1:]], capture_output=True, text=True, env=full, timeout=600
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A key pair made by ``kunlun-cli keys generate`` (kunlun-signing.key / .pub)."""
    out = tmp_path_factory.mktemp("keys")
    run("kunlun-cli", "keys", "generate", "--out", str(out / "k"), home=out / "home")
    return out / "k"


@pytest.fixture(scope="session")
def other_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("other-keys")
    run("kunlun-cli", "keys", "generate", "--out", str(out / "k"), home=out / "home")
    return out / "k"


@pytest.fixture(scope="session")
def demo_fp32(demo_model_dir: Path) -> Path:
    """The demo model (SmolLM2-135M-Instruct) imported as float32, in a folder ``smollm2``."""
    return demo_model_dir


@pytest.fixture(scope="session")
def tiny_llama(tiny_model: Path) -> Path:
    """A seeded random tiny Llama with the built-in tokenizer."""
    return tiny_model


PackFn = Callable[..., Path]


@pytest.fixture(scope="session")
def pack_tiny(tiny_llama: Path, keys: Path, tmp_path_factory: pytest.TempPathFactory) -> PackFn:
    """``pack_tiny(version=1, **options) -> package path``: the tiny model packed for cpu:0 by
    ``kunlun-cli model pack`` (cached per arguments)."""
    root = tmp_path_factory.mktemp("packs")
    cache: dict[tuple[object, ...], Path] = {}

    def pack(version: int = 1, name: str = "tiny", created: int = 1_790_000_000,
             target_device: str = "cpu:0", **extra: str) -> Path:  # fmt: skip
        key = (version, name, created, target_device, tuple(sorted(extra.items())))
        if key not in cache:
            model = root / name
            if not model.exists():
                model.symlink_to(tiny_llama, target_is_directory=True)
            out = root / f"{name}-{version}-{len(cache)}.kunlunpkg"
            args = ["kunlun-cli", "model", "pack", "--model", str(model), "--target-device",
                    target_device, "--key", str(keys / "kunlun-signing.key"), "-o", str(out),
                    "--package-version", str(version), "--created", str(created)]  # fmt: skip
            for option, value in extra.items():
                args += [f"--{option.replace('_', '-')}", value]
            run(*args, home=root / "home")
            cache[key] = out
        return cache[key]

    return pack


def signed_manifest(
    key_path: Path, files: dict[str, bytes], name: str = "tiny", version: int = 1
) -> tuple[bytes, bytes]:
    """A manifest listing ``files`` (path -> bytes), and its signature by ``key_path``."""
    import hashlib

    key = load_private_key(key_path)
    manifest = Manifest(
        format=PACKAGE_FORMAT,
        name=name,
        version=version,
        created="2026-12-01T00:00:00Z",
        kunlun_version="0.1.0",
        signer=fingerprint(key.public_key()),
        files=[
            FileEntry(p, len(d), hashlib.sha256(d).hexdigest()) for p, d in sorted(files.items())
        ],
        extra={"model": {}},
    )
    data = dump(manifest)
    return data, sign(key, data)


def raw_package(
    out: Path,
    manifest: bytes,
    signature: bytes,
    members: list[tuple[tarfile.TarInfo, bytes | None]],
    mode: str = "w",
) -> Path:
    """A tar with ``manifest.json``, ``manifest.sig`` and then ``members`` exactly as given
    (names, types and sizes unchecked: this is how a hostile package is made)."""
    with tarfile.open(out, mode) as tar:  # type: ignore[call-overload]
        for name, data in (("manifest.json", manifest), ("manifest.sig", signature)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out


def member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    return info, data


MODEL_FILES = {
    "model/config.json": b'{"model_type": "llama"}',
    "model/model.safetensors": b"\x00" * 64,
    "plan/plan.json": b"{}",
    "plan/device-profile.json": b'{"snapshot": []}',
}
"""A package's minimum set of members (contents are not planned: refusals come first)."""
