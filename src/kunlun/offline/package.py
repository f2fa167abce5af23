"""Model packages (``.kunlunpkg``): pack on a connected machine, verify and inspect anywhere.

``kunlun-cli model pack --model M --target-device cpu:0 --key K -o M.kunlunpkg`` plans M for
the target (``--replay``/``--config`` plan for a recorded node, e.g. ``ascend:0``), writes
the weights the plan runs (cast to its dtype; quantized with ``--quantize``), and packs:

- ``model/``: the weights (safetensors), ``config.json``, the tokenizer and its chat
  template, the generation config, the model card (``README.md``) when there is one;
- ``plan/plan.json``: the execution plan; ``plan/engine.json``: the engine launch the plan
  gives (model directory relative to the package); ``plan/device-profile.json``: the profile
  of each target device and the snapshot the plan cache keys on;
  ``plan/device-plugin-config.yaml``: the declaration the plan was made against, when one was;
- ``manifest.json`` (:mod:`.manifest`) and ``manifest.sig`` (Ed25519 over its bytes).

Packing is reproducible: the same model, plan, key, version and creation time
(``SOURCE_DATE_EPOCH``, or ``--created``) give the same bytes; any two packs of the same
model and plan give the same file hashes.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kunlun import __version__
from kunlun.errors import ConfigError, Location, PackageError
from kunlun.offline.archive import (
    ArchiveError,
    ArchiveReader,
    hash_file,
    refused,
    write_archive,
)
from kunlun.offline.manifest import PACKAGE_FORMAT, FileEntry, Manifest, ManifestError, dump, parse
from kunlun.offline.signing import TrustedKeys, fingerprint, load_private_key, sign

if TYPE_CHECKING:
    from kunlun.engine.launch import EngineLaunch
    from kunlun.planner.plan import ExecutionPlan

MODEL_DIR = "model"
PLAN_FILE = "plan/plan.json"
ENGINE_FILE = "plan/engine.json"
PROFILE_FILE = "plan/device-profile.json"
DECLARATION_FILE = "plan/device-plugin-config.yaml"
_SKIP = {"conversion.json", "kunlun-import.json"}
"""Model files that record where and when this machine made them: not shipped."""


def model_license(model_dir: Path) -> str | None:
    """The licence of a model: ``license:`` in its model card's front matter (``README.md``,
    the Hugging Face convention; the GGUF importer writes one from ``general.license``)."""
    card = model_dir / "README.md"
    if not card.is_file():
        return None
    lines = card.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    for line in lines[1:]:
        if line.strip() == "---":
            break
        key, _, value = line.partition(":")
        if key.strip() == "license" and value.strip():
            return value.strip().strip("'\"")
    return None


MAX_CREATED = 8**11 - 1
"""The latest creation time a plain tar header holds (2242-03-16): a later one, or one
before 1970, would need a PAX header before ``manifest.json``, which readers refuse."""


def created_time(created: int | None = None) -> int:
    """The creation time of a pack: ``created``, else ``SOURCE_DATE_EPOCH``, else now."""
    where = "--created"
    if created is None:
        env = os.environ.get("SOURCE_DATE_EPOCH")
        where = "SOURCE_DATE_EPOCH" if env else "the clock"
        try:
            created = int(env) if env else int(time.time())
        except ValueError:
            raise ConfigError(
                f"SOURCE_DATE_EPOCH must be whole seconds: {env!r}", location=Location(where)
            ) from None
    if not 0 <= created <= MAX_CREATED:
        raise ConfigError(
            f"the creation time must be from 0 to {MAX_CREATED} seconds: {created}",
            location=Location(where),
        )
    return created


def checked_manifest(data: bytes, out: Path, expect_format: str) -> bytes:
    """``data`` once the readers' own parser accepts it: nothing is packed that ``verify``,
    ``inspect`` or ``install`` would refuse (a ``--package-version`` of 0, a model alias
    that is no package name)."""
    try:
        parse(data, f"{out}:manifest.json", expect_format)
    except ManifestError as exc:
        raise ConfigError(f"refusing to write a manifest no installer accepts: {exc}") from None
    return data


def iso_utc(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PackResult:
    path: Path
    manifest: Manifest
    seconds: float


@dataclass
class PackInput:
    """What a package holds besides the weights, planned by the layer above
    (:func:`kunlun.workload.packing.plan_package`): packing writes it and plans nothing."""

    name: str
    """The package's name (the model's alias)."""
    path: Path
    """Where the model's files are on this machine."""
    plan: ExecutionPlan
    launch: EngineLaunch
    """The engine launch the plan gives, its model directory relative to the package."""
    snapshot: list[dict[str, Any]]
    """The snapshot of each target device the plan cache keys on."""
    profiles: list[dict[str, Any]]
    """The profile of each target device."""
    device_types: list[str]
    min_memory_mb: int
    """Weights and one sequence's KV cache at ``max_model_len``."""
    declaration: Path | None
    """The declaration the plan was made against, when one was."""


def pack(
    source: PackInput,
    out: Path,
    key_path: Path,
    *,
    version: int | None = None,
    created: int | None = None,
) -> PackResult:
    """Write the signed package ``out`` of ``source``: the weights its plan runs, the plan,
    the launch, the device profiles and the manifest."""
    from kunlun.engine.convert import prepare_weights

    started = time.perf_counter()
    key = load_private_key(key_path)
    signer = fingerprint(key.public_key())
    when = created_time(created)
    plan, path = source.plan, source.path
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".kunlunpkg-", dir=out.parent) as scratch:
        work = Path(scratch)
        weights, _ = prepare_weights(path, work / "weights", plan.dtype, plan.quantization)
        files: list[tuple[str, Path]] = [
            (f"{MODEL_DIR}/{p.name}", p)
            for p in sorted(weights.iterdir())
            if p.name not in _SKIP and p.resolve().is_file()
        ]
        generated: dict[str, Any] = {
            PLAN_FILE: plan.to_dict(),
            ENGINE_FILE: json.loads(source.launch.model_dump_json()),
            PROFILE_FILE: {"snapshot": source.snapshot, "profiles": source.profiles},
        }
        for member, data in generated.items():
            target = work / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            files.append((member, target))
        if source.declaration is not None:
            files.append((DECLARATION_FILE, source.declaration))
        files.sort()
        entries = []
        for member, file in files:
            size, digest = hash_file(file)
            entries.append((FileEntry(member, size, digest), file))
        manifest = Manifest(
            format=PACKAGE_FORMAT,
            name=source.name,
            version=version if version is not None else when,
            created=iso_utc(when),
            kunlun_version=__version__,
            signer=signer,
            files=[e for e, _ in entries],
            extra={
                "model": {
                    "architecture": plan.architecture,
                    "dtype": plan.dtype,
                    "quantization": plan.quantization,
                    "target_devices": plan.devices,
                    "target_device_types": source.device_types,
                    "tensor_parallel_size": plan.tensor_parallel_size,
                    "min_memory_mb": source.min_memory_mb,
                    "license": model_license(path),
                    "plan_summary": plan.summary(),
                    "declaration": DECLARATION_FILE if source.declaration is not None else None,
                }
            },
        )
        data = checked_manifest(dump(manifest), out, PACKAGE_FORMAT)
        write_archive(out, data, sign(key, data), entries, when)
    return PackResult(out, manifest, time.perf_counter() - started)


@dataclass
class VerifyReport:
    manifest: Manifest
    signer: str
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def read_manifest(reader: ArchiveReader, trusted: TrustedKeys | None) -> tuple[Manifest, str]:
    """The package's manifest and its signer's fingerprint: verified against ``trusted``
    first, when given (an unverified manifest is only parsed, for ``inspect``). Whatever
    is wrong is a :class:`PackageError` (exit status 3) naming the package and the cause."""
    try:
        data, signature = reader.header()
    except ArchiveError as exc:
        raise refused(exc, reader.path) from None
    where = f"{reader.path}:manifest.json"
    signer = ""
    if trusted is not None:
        signer = trusted.verify(data, signature, where)
    try:
        manifest = parse(data, where, PACKAGE_FORMAT)
    except ManifestError as exc:
        raise refused(exc, reader.path) from None
    return manifest, signer or manifest.signer


def open_package(path: Path) -> ArchiveReader:
    if not path.is_file():
        raise PackageError("package file not found", location=Location(str(path)))
    try:
        return ArchiveReader(path)
    except ArchiveError as exc:
        raise refused(exc, path) from None


def verify(path: Path, trusted: TrustedKeys) -> VerifyReport:
    """Check the signature, then stream every member against its hash; raises
    :class:`PackageError` (or its :class:`~kunlun.errors.SignatureError`) naming the cause."""
    started = time.perf_counter()
    with open_package(path) as reader:
        manifest, signer = read_manifest(reader, trusted)
        try:
            total = sum(entry.size for entry in reader.files(manifest))
        except ArchiveError as exc:
            raise refused(exc, path) from None
    return VerifyReport(manifest, signer, total, time.perf_counter() - started)


def inspect(path: Path, trusted: TrustedKeys | None = None) -> dict[str, Any]:
    """What a package is for, from its manifest (signature checked when ``trusted`` given)."""
    with open_package(path) as reader:
        manifest, signer = read_manifest(reader, trusted)
    model = manifest.extra.get("model") or {}
    return {
        "package": str(path),
        "name": manifest.name,
        "version": manifest.version,
        "created": manifest.created,
        "kunlun_version": manifest.kunlun_version,
        "signer": signer,
        "signature": "verified" if trusted is not None else "not checked (give --public-key)",
        "files": len(manifest.files),
        "bytes": manifest.total_bytes,
        **{
            k: model.get(k)
            for k in (
                "target_device_types",
                "target_devices",
                "dtype",
                "quantization",
                "tensor_parallel_size",
                "min_memory_mb",
                "license",
                "plan_summary",
                "declaration",
            )
        },  # fmt: skip
    }
