"""The plan cache (the seeds' model compilation cache and device profile snapshot).

An entry lives in ``KUNLUN_HOME/plan-cache/<key>/`` and holds ``plan.json`` (the plan of the
latest start), ``launch.json`` (the :class:`~kunlun.engine.launch.EngineLaunch` the plan gave
that start's worker, before the node agent added its ready file and sandbox), ``key.json``
(what the key was made of): the daemon's own :data:`BOOKKEEPING`, rewritten by each start and
read by no engine. Everything else in it is a conversion artifact the engine reuses
(:func:`artifacts`): ``weights/``, the checkpoint already cast to the plan's dtype and
quantized as it says (see :mod:`kunlun.engine.convert`, its record ``weights/conversion.json``),
so a second start loads it directly, or an external engine's export (a GGUF file). With
``--require-signed`` those are derived from a signed package and sealed by the daemon
(:meth:`kunlun.offline.integrity.ModelGuard.check_conversion`): re-hashed before reuse and by
the integrity sweep.

The key is the SHA-256 of:

- the model's *content fingerprint*: the bytes of ``config.json`` plus the name, size and
  modification time (ns) of every weight file (``*.safetensors`` and the shard index); a
  re-imported or edited model gets a new fingerprint without hashing gigabytes;
- the *device profile snapshot* of every device in the replica's group: the profile fields
  that affect a plan (type, memory and where it came from, dtypes, compute, bandwidth, P2P,
  topology, vendor attributes), never the volatile ones (used memory, utilization,
  temperature);
- the Kunlun version;
- the plan decisions that artifacts depend on: engine, dtype, quantization, tensor-parallel
  size; and the spec's ``memory_utilization`` when it sets one (a different fraction is a
  different plan; without one, keys stay as they were before the field existed).

A changed device declaration therefore changes the key: the next start is a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun import __version__
from kunlun.planner.capacity import DeviceCapacity
from kunlun.planner.plan import ExecutionPlan

CACHE_DIR = "plan-cache"
WEIGHTS_DIR = "weights"
LAUNCH_FILE = "launch.json"
BOOKKEEPING = frozenset({"plan.json", "key.json", LAUNCH_FILE})
"""The files of an entry the daemon writes itself (no engine loads them)."""
_WEIGHT_SUFFIXES = (".safetensors",)
_INDEX = "model.safetensors.index.json"


def model_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 of ``config.json`` and the name, size and mtime of each weight file."""
    root = Path(model_dir)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    for path in sorted(root.iterdir()):
        if path.suffix in _WEIGHT_SUFFIXES or path.name == _INDEX:
            stat = path.stat()
            digest.update(f"\0{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def device_snapshot(cap: DeviceCapacity) -> dict[str, Any]:
    """The fields of a device profile that affect its plans."""
    return {
        "device": cap.device_id,
        "memory_total_mb": cap.memory_total_mb,
        "memory_source": cap.memory_source,
        "host_memory_mb": cap.host_memory_mb,
        "supported_dtypes": sorted(cap.dtypes),
        "emulated_dtypes": sorted(cap.emulated),
        "compute_tflops": dict(sorted(cap.compute.items())),
        "memory_bandwidth_gbps": cap.bandwidth_gbps,
        "p2p_enabled": cap.p2p,
        "topology_distance": list(cap.topology) if cap.topology else None,
        "torch_device_type": cap.torch_device_type,
        "custom_attributes": dict(sorted(cap.custom_attributes.items())),
    }


def key_inputs(
    fingerprint: str, snapshots: list[dict[str, Any]], plan: ExecutionPlan
) -> dict[str, Any]:
    """What an entry's key is made of; ``snapshots``: :func:`device_snapshot` of each device."""
    decisions: dict[str, Any] = {
        "engine": plan.engine,
        "dtype": plan.dtype,
        "quantization": plan.quantization,
        "tensor_parallel_size": plan.tensor_parallel_size,
    }
    if plan.memory_utilization is not None:
        decisions["memory_utilization"] = plan.memory_utilization
    return {
        "model": fingerprint,
        "devices": snapshots,
        "kunlun_version": __version__,
        "plan": decisions,
    }


@dataclass(frozen=True)
class CacheEntry:
    key: str
    path: Path
    hit: bool

    @property
    def weights_dir(self) -> Path:
        return self.path / WEIGHTS_DIR


def artifacts(entry: Path) -> list[Path]:
    """The conversion artifacts in the entry directory ``entry`` (sorted): all it holds but
    :data:`BOOKKEEPING` and hidden names (a conversion's staging directory, a temporary file:
    never loaded)."""
    try:
        names = sorted(os.listdir(entry))
    except FileNotFoundError:
        return []
    return [entry / n for n in names if n not in BOOKKEEPING and not n.startswith(".")]


class PlanCache:
    """Entries under ``home/plan-cache``."""

    def __init__(self, home: Path) -> None:
        self.root = home / CACHE_DIR

    def entry(
        self, plan: ExecutionPlan, model_dir: str | Path, group: list[DeviceCapacity]
    ) -> CacheEntry:
        """The entry of ``plan`` (hit when it already existed); writes ``plan.json``."""
        return self.seed(plan, model_dir, [device_snapshot(c) for c in group])

    def seed(
        self, plan: ExecutionPlan, model_dir: str | Path, snapshots: list[dict[str, Any]]
    ) -> CacheEntry:
        """The entry of ``plan`` for devices described by ``snapshots`` (a signed package's
        device profile snapshot: the installer seeds the entry, so the first start on the
        device the package was planned for is a hit)."""
        inputs = key_inputs(model_fingerprint(model_dir), snapshots, plan)
        key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]
        path = self.root / key
        hit = (path / "key.json").is_file()
        path.mkdir(parents=True, exist_ok=True)
        if not hit:
            _write_json(path / "key.json", inputs)
        _write_json(path / "plan.json", plan.to_dict())
        return CacheEntry(key, path, hit)


def _write_json(path: Path, data: Any) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(temporary, path)
