"""Placement speed: 1,000 workloads, one after another, on 10,000 devices; prints one JSON object.

The inventory is synthetic but shaped like real nodes: 10,000 device profiles of six SKUs
(Ascend 910B, MLU370-X4, T4, H100, MI300X, Hygon K100 figures), each with its own probed used
memory, 2% Degraded and 1% Unhealthy. The workloads are the four shipped model
configurations (``examples/models``) with random quantization, priority, scorer, batch size,
context, replicas and, for a fifth of them, preferred device types (fixed seed). Models are
inspected and specs validated before the clock starts; the timed part is what placement does
per workload: the device capacities and classes are built once, then each workload is
filtered, scored, planned and its memory reserved, so later workloads see it used. No I/O.

``placement_s_1000_workloads_10000_devices`` is the best of ``--repeats`` runs (each from a
fresh inventory) in wall seconds, from the device profiles to the last placement; the best
run's breakdown (device capacities and classes built, placements) and CPU seconds, and the
median, are reported too.

Usage: ``python benchmarks/placement.py [--repeats 3] [--workloads 1000] [--devices 10000]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from kunlun.device.dtypes import normalize_compute
from kunlun.device.profile import DeviceProfile, Provenance, Status
from kunlun.errors import ConfigError
from kunlun.planner.capacity import capacity_of
from kunlun.planner.model_info import ModelInfo, inspect_model
from kunlun.workload.placement import Placer, demand_of
from kunlun.workload.spec import WorkloadSpec

MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"

#: (device_type, torch device, memory MiB, dtypes, fp16 TFLOPS, int8 TOPS, GB/s, visibility)
SKUS = [
    ("ascend", "npu", 65536, ["fp16", "bf16", "int8"], 256, 512, 1600, "ASCEND_RT_VISIBLE_DEVICES"),
    ("cambricon", "mlu", 24576, ["fp32", "fp16", "bf16", "int8"], 96, 256, 307.2, "MLU_VISIBLE_DEVICES"),
    ("nvidia", "cuda", 15360, ["fp32", "fp16", "int8"], 65, 130, 320, "CUDA_VISIBLE_DEVICES"),
    ("nvidia", "cuda", 81559, ["fp32", "bf16", "fp16", "int8"], 989, 1979, 3350, "CUDA_VISIBLE_DEVICES"),
    ("amd", "cuda", 196592, ["fp32", "bf16", "fp16", "int8"], 1307, 2615, 5300, "HIP_VISIBLE_DEVICES"),
    ("hygon", "cuda", 65520, ["fp32", "bf16", "fp16", "int8"], 196, 392, 896, "HIP_VISIBLE_DEVICES"),
]  # fmt: skip


def inventory(num_devices: int, rng: random.Random) -> list[DeviceProfile]:
    """``num_devices`` synthetic profiles, indices counted per device type."""
    counts: dict[str, int] = {}
    out = []
    declared = Provenance.DECLARED
    for _ in range(num_devices):
        kind, torch_type, memory, dtypes, fp16, int8, bandwidth, env = rng.choice(SKUS)
        index = counts.get(kind, 0)
        counts[kind] = index + 1
        p = DeviceProfile(kind, index, visibility_env=env, torch_device_type=torch_type)
        p.set("memory_total_mb", memory, declared)
        p.set("memory_used_mb", rng.randint(0, memory // 8), Provenance.PROBED)
        p.set("supported_dtypes", dtypes, declared)
        p.set("p2p_enabled", True, declared)
        compute = normalize_compute({"fp16": fp16, "int8": int8})
        p.set("compute_tflops", {d: v for d, (v, _) in compute.items()}, declared)
        p.set("memory_bandwidth_gbps", bandwidth, declared)
        roll = rng.random()
        if roll < 0.01:
            p.degrade(Status.UNHEALTHY, "vendor tool reports health 'Critical'")
        elif roll < 0.03:
            p.degrade(Status.DEGRADED, "vendor tool reports health 'Warning'")
        out.append(p)
    return out


def workloads(num: int, rng: random.Random) -> list[WorkloadSpec]:
    names = sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file())
    types = sorted({s[0] for s in SKUS})
    specs = []
    for _ in range(num):
        preferred = rng.sample(types, 2) if rng.random() < 0.2 else []
        specs.append(
            WorkloadSpec(
                model=rng.choice(names),
                quantization=rng.choice(["none", "none", "w8a8", "w4a16"]),
                priority=rng.choice(["high", "normal", "normal", "low"]),
                scorer=rng.choice(["performance", "roofline", "binpack", "spread"]),
                max_num_seqs=rng.choice([8, 16, 64]),
                max_model_len=rng.choice([2048, 4096, 8192]),
                replicas=rng.choice([1, 1, 1, 2]),
                preferred_device_types=preferred,
            )
        )
    return specs


def run_once(profiles: list[DeviceProfile], specs: list[WorkloadSpec],
             models: dict[str, ModelInfo]) -> dict[str, float]:  # fmt: skip
    """Place every spec in order on a fresh inventory; wall and CPU seconds, and counts."""
    wall, cpu = time.perf_counter(), time.process_time()
    placer = Placer([capacity_of(p) for p in profiles])
    built = time.perf_counter()
    placed = refused = 0
    for spec in specs:
        try:
            placer.place(demand_of(spec, models[spec.model]))
            placed += 1
        except ConfigError:
            refused += 1
    end = time.perf_counter()
    return {"total_s": end - wall, "cpu_s": time.process_time() - cpu,
            "inventory_s": built - wall, "placements_s": end - built,
            "placed": placed, "refused": refused, "classes": len(placer.pools)}  # fmt: skip


def measure(
    num_workloads: int = 1000, num_devices: int = 10000, repeats: int = 3
) -> dict[str, Any]:
    """The placement figures as one dict (``benchmarks/scheduler.py`` folds them in)."""
    rng = random.Random(20261130)
    specs = workloads(num_workloads, rng)
    models = {spec.model: inspect_model(MODELS / spec.model) for spec in specs}
    runs = [run_once(inventory(num_devices, random.Random(7)), specs, models)
            for _ in range(repeats)]  # fmt: skip
    best = min(runs, key=lambda r: r["total_s"])
    key = f"placement_s_{num_workloads}_workloads_{num_devices}_devices"
    return {
        key: round(best["total_s"], 4),
        "placement_median_s": round(statistics.median(r["total_s"] for r in runs), 4),
        "placement_best_run": {k: round(v, 4) for k, v in best.items()},
        "placement_runs_s": [round(r["total_s"], 4) for r in runs],
        "placement_target_s": 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", type=int, default=1000)
    parser.add_argument("--devices", type=int, default=10000)
    args = parser.parse_args()
    result = measure(args.workloads, args.devices, args.repeats)
    print(json.dumps({**result, "python": platform.python_version()}))


if __name__ == "__main__":
    main()
