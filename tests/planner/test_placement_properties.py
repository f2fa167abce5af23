"""Properties of placement over random inventories and random workload sequences."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from tests.planner.conftest import model

from kunlun.device.dtypes import normalize_compute
from kunlun.device.profile import DeviceProfile, Provenance, Status
from kunlun.errors import ConfigError
from kunlun.planner.capacity import DeviceCapacity, capacity_of
from kunlun.workload.ledger import Ledger
from kunlun.workload.placement import Placement, Placer, demand_of
from kunlun.workload.spec import WorkloadSpec

MODELS = {name: model(name) for name in ("Qwen2-0.5B", "Llama-3-8B", "Qwen3-8B")}
DTYPE_SETS = [["fp16", "int8"], ["bf16", "fp16"], ["fp32", "bf16", "fp16", "int8"], ["fp32"]]


def profile(
    kind: int, index: int, memory_mb: int, dtypes: list[str], degraded: bool
) -> DeviceProfile:
    p = DeviceProfile(f"type{kind}", index, torch_device_type="cuda")
    declared = Provenance.DECLARED
    p.set("memory_total_mb", memory_mb, declared)
    p.set("memory_used_mb", 0, Provenance.PROBED)
    p.set("supported_dtypes", dtypes, declared)
    p.set("p2p_enabled", True, declared)
    compute = normalize_compute({"fp16": 50.0 * (kind + 1)})
    p.set("compute_tflops", {d: v for d, (v, _) in compute.items()}, declared)
    p.set("memory_bandwidth_gbps", 400.0 * (3 - kind), declared)
    if degraded:
        p.degrade(Status.DEGRADED, "test: degraded")
    return p


devices = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.sampled_from([8192, 16384, 24576, 65536]),
        st.sampled_from(range(len(DTYPE_SETS))),
        st.booleans(),
    ),
    min_size=1,
    max_size=10,
)
workloads = st.lists(
    st.fixed_dictionaries(
        {
            "model": st.sampled_from(sorted(MODELS)),
            "priority": st.sampled_from(["high", "normal", "low"]),
            "quantization": st.sampled_from(["none", "w8a8", "w4a16"]),
            "scorer": st.sampled_from(["performance", "roofline", "binpack", "spread"]),
            "max_model_len": st.sampled_from([2048, 8192]),
            "max_num_seqs": st.sampled_from([None, 1, 8, 64]),
        }
    ),
    min_size=1,
    max_size=12,
)


def inventory(spec: list[tuple[int, int, int, bool]]) -> list[DeviceCapacity]:
    counts: dict[int, int] = {}
    out = []
    for kind, memory, dtypes, degraded in spec:
        index = counts.get(kind, 0)
        counts[kind] = index + 1
        out.append(capacity_of(profile(kind, index, memory, DTYPE_SETS[dtypes], degraded)))
    return out


@settings(max_examples=60, deadline=None)
@given(devices, workloads)
def test_placement_never_overcommits_and_respects_capabilities(
    device_spec: list[tuple[int, int, int, bool]], specs: list[dict[str, object]]
) -> None:
    caps = inventory(device_spec)
    by_id = {c.device_id: c for c in caps}
    placer = Placer(caps)
    for fields in specs:
        spec = WorkloadSpec.model_validate(fields)
        demand = demand_of(spec, MODELS[spec.model])
        try:
            placement = placer.place(demand)
        except ConfigError:
            continue
        plan = placement.plans[0]
        for device_id in plan.devices:
            cap = by_id[device_id]
            assert plan.dtype in cap.dtypes
            assert spec.quantization != "w8a8" or "int8" in cap.dtypes
        if any(by_id[d].degraded for d in plan.devices):  # only when no Ready device fits
            ready = Placer([c for c in caps if not c.degraded], placer.ledger)
            try:
                ready.place(demand)
                raise AssertionError("a Degraded device was chosen while a Ready one fits")
            except ConfigError:
                pass
        ledger = placer.ledger
        for device_id, weights in ledger.weights.items():
            cap = by_id[device_id]
            kv_floor = ledger.priority[device_id] * ledger.kv_per_weight[device_id]
            assert weights + kv_floor <= cap.usable_mb + 1e-6


@settings(max_examples=50, deadline=None)
@given(
    devices,
    workloads,
    st.sampled_from(sorted(MODELS)),
    st.sampled_from(["none", "w8a8"]),
    st.sampled_from(["performance", "roofline", "binpack", "spread"]),
)
def test_the_scorer_picks_the_best_class(
    device_spec: list[tuple[int, int, int, bool]],
    prior: list[dict[str, object]],
    name: str,
    quantization: str,
    scorer: str,
) -> None:
    """After random earlier placements, the chosen device scores at least as well as what
    each class alone would offer (classes skipped as unable to win really could not)."""
    caps = [c for c in inventory(device_spec) if not c.degraded]
    if not caps:
        return
    earlier = Placer(caps)
    held: list[dict[str, Any]] = []
    for fields in prior:
        spec = WorkloadSpec.model_validate(fields)
        try:
            placed = earlier.place(demand_of(spec, MODELS[spec.model]))
        except ConfigError:
            continue
        held += [r.to_dict() for r in placed.reservations]
    demand = demand_of(
        WorkloadSpec(model=name, quantization=quantization, scorer=scorer), MODELS[name]
    )
    by_id = {c.device_id: c for c in caps}

    def score(placement: Placement) -> tuple[float, ...]:
        plan = placement.plans[0]
        decode = -(plan.estimated_tokens_per_s or 0.0)
        if scorer == "performance":
            return (-(plan.compute_tokens_per_s or 0.0), decode)
        if scorer == "roofline":
            return (decode,)
        ledger = Ledger.from_reservations(held)
        free = min(ledger.headroom(by_id[d]) for d in plan.devices)
        # free memory is a float sum: compared to the nearest MiB/1000
        return (round(free, 3),) if scorer == "binpack" else (round(-free, 3),)

    try:
        chosen = score(Placer(caps, Ledger.from_reservations(held)).place(demand))
    except ConfigError:
        chosen = (math.inf,)
    for signature in {c.signature for c in caps}:
        alone = [c for c in caps if c.signature == signature]
        try:
            offer = score(Placer(alone, Ledger.from_reservations(held)).place(demand))
        except ConfigError:
            continue
        assert chosen <= offer
