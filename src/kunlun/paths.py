"""Where Kunlun keeps its state on disk: everything lives under ``KUNLUN_HOME``."""

from __future__ import annotations

import os
from pathlib import Path


def kunlun_home() -> Path:
    """``$KUNLUN_HOME``, or ``~/.kunlun`` when unset. Created on first use."""
    home = Path(os.environ.get("KUNLUN_HOME") or Path.home() / ".kunlun")
    home.mkdir(parents=True, exist_ok=True)
    return home


def model_cache_dir() -> Path:
    """Imported and converted models (GGUF -> safetensors) live here."""
    path = kunlun_home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
