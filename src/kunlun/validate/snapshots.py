"""Known-good snapshots: the minimal reproducible configuration of a model that served well
on one pool and engine, to compare later runs with and to roll back to.

A snapshot is one JSON file in a snapshot folder (default ``KUNLUN_HOME/snapshots``):
the model (as asked, its path and content fingerprint where its files are on this machine),
the pool and engine, the workload spec submitted, the plan, the profiles of the plan's
devices as the platform saw them (driver and toolkit versions the plugin reported among
them), the Kunlun version and endpoint, the figures measured (accuracy, tokens/s, the
battery's counts), and the greedy answers of :data:`PROMPTS`, which ``snapshot restore
--check`` asks again. ``kunlun-cli adapt`` writes one for every pool and engine that passes
and compares each new run with the last one of the same model, pool and engine.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from kunlun.errors import ConfigError, Location
from kunlun.paths import kunlun_home

FORMAT = 1
DIR_NAME = "snapshots"
PROMPTS = ("The capital of France is", "1, 2, 3, 4,", "Once upon a time")
"""Greedy fingerprint prompts (8 tokens each): a restored workload answers them alike."""
FINGERPRINT_TOKENS = 8
VOLATILE = ("id", "created", "endpoint")
"""Fields :func:`diff` leaves out (they differ between any two snapshots)."""


def default_dir() -> Path:
    return kunlun_home() / DIR_NAME


def new_id(model: str, pool: str, engine: str, when: float) -> str:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{Path(model).name}-{pool}-{engine}").strip("-")
    return (
        f"{slug}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(when))}-{int(when * 1000) % 1000:03d}"
    )


def save(folder: Path, snapshot: dict[str, Any]) -> Path:
    """Write ``snapshot`` (given its ``id``) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{snapshot['id']}.json"
    path.write_text(json.dumps({"format": FORMAT, **snapshot}, indent=2, sort_keys=True) + "\n")
    return path


def load(folder: Path, snapshot_id: str) -> dict[str, Any]:
    """The snapshot ``snapshot_id`` (a file name without ``.json``, or a path)."""
    path = Path(snapshot_id) if snapshot_id.endswith(".json") else folder / f"{snapshot_id}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        known = ", ".join(s["id"] for s in listed(folder)[-5:]) or "none"
        raise ConfigError(f"no snapshot {snapshot_id!r} in {folder} (latest: {known})",
                          location=Location(str(path))) from None  # fmt: skip
    except (OSError, ValueError) as exc:
        raise ConfigError(f"not a snapshot: {exc}", location=Location(str(path))) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "spec" not in data:
        raise ConfigError(f"not a snapshot of format {FORMAT}",
                          location=Location(str(path), field="format"))  # fmt: skip
    return data


def listed(folder: Path, unread: list[str] | None = None) -> list[dict[str, Any]]:
    """Every readable snapshot in ``folder``, oldest first; why each other ``.json`` file
    there is not one goes to ``unread`` (the callers say it)."""
    found = []
    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            found.append(load(folder, path.stem))
        except ConfigError as exc:
            if unread is not None:
                unread.append(str(exc))
    return sorted(found, key=lambda s: (s.get("created", 0), s["id"]))


def last_known_good(
    folder: Path, model: str, pool: str, engine: str, unread: list[str] | None = None
) -> dict[str, Any] | None:
    same = [s for s in listed(folder, unread)
            if (s.get("model"), s.get("pool"), s.get("engine")) == (model, pool, engine)]  # fmt: skip
    return same[-1] if same else None


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(field, in a, in b)`` for every field that differs, dotted, in order."""
    left = flatten({k: v for k, v in a.items() if k not in VOLATILE})
    right = flatten({k: v for k, v in b.items() if k not in VOLATILE})
    return [(key, left.get(key), right.get(key)) for key in sorted(left.keys() | right.keys())
            if left.get(key) != right.get(key)]  # fmt: skip
