"""Which GGUF file an imported model directory was made from (no torch needed).

:func:`kunlun.engine.gguf.import_gguf` records the file's path and identity (size, mtime,
sha256 of its first MiB: :func:`import_key`) in the directory's :data:`MARKER`. Engines
that serve GGUF files themselves (llama.cpp) ask :func:`gguf_source` for the original file,
which is offered only while it is still the file that was imported.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MARKER = "kunlun-import.json"
"""The import record in an imported model directory."""


def import_key(gguf_path: Path) -> dict[str, Any]:
    """The identity of a GGUF file: size, mtime and the sha256 of its first MiB."""
    stat = gguf_path.stat()
    with gguf_path.open("rb") as handle:
        head = hashlib.sha256(handle.read(1 << 20)).hexdigest()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256_first_mib": head}


def gguf_source(model_dir: str | Path | None) -> Path | None:
    """The GGUF file ``model_dir`` was imported from, when the directory is an import and
    the file is still there, unchanged (same size and first MiB); else None. A model that is
    itself a ``.gguf`` path is its own source."""
    if model_dir is None:
        return None
    folder = Path(model_dir)
    if folder.suffix.lower() == ".gguf":
        return folder if folder.is_file() else None
    try:
        record = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        source = Path(record["source"])
        key = import_key(source)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    same = all(record.get(k) == key[k] for k in ("size", "sha256_first_mib"))
    return source if same else None


def kept_quantization(model_dir: str | Path) -> str | None:
    """The Kunlun quantization of an imported model directory that kept its GGUF file's
    4-bit blocks (``w4a16``), or None (a float import, or not an import)."""
    try:
        record = json.loads((Path(model_dir) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    output = record.get("output") if isinstance(record, dict) else None
    if isinstance(output, dict) and output.get("keep_quantized"):
        return "w4a16"
    return None
