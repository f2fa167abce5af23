"""Placement on recorded nodes: filters with reasons, scorers, topology, priority shares."""

from __future__ import annotations

from typing import Any

import pytest
from tests.planner.conftest import EditConfig, model, node

from kunlun.errors import ConfigError
from kunlun.planner.capacity import capacity_of
from kunlun.planner.estimate import tokens_per_s
from kunlun.workload.placement import Ledger, Placer, demand_of, place
from kunlun.workload.spec import WorkloadSpec

LLAMA = model("Llama-3-8B")


def int8_llama(**fields: Any) -> WorkloadSpec:
    return WorkloadSpec(model="Llama-3-8B", quantization="w8a8", **fields)


def device_types(target: str) -> set[str]:
    return {d.split(":")[0] for d in target.split(",")}


# ---- the mixed node: 4 x Ascend 910B, 2 x MLU370-X4, 1 x T4 ----


def test_int8_llama_goes_to_the_pool_with_the_higher_int8_throughput() -> None:
    inventory = node("mixed")
    placement = place(int8_llama(), inventory, LLAMA)
    assert device_types(placement.target_device) == {"ascend"}
    plan = placement.plans[0]
    assert plan.quantization == "w8a8" and plan.dtype == "bf16"
    caps = {p.device_type: capacity_of(p) for p in inventory.profiles}
    assert caps["ascend"].compute["int8"] > caps["cambricon"].compute["int8"]
    mlu = tokens_per_s(LLAMA, caps["cambricon"], "bf16", "w8a8", 1, 8, 8192)
    assert mlu is not None and plan.estimated_tokens_per_s is not None
    assert plan.estimated_tokens_per_s > mlu
    assert "performance: int8 compute 512 TOPS" in placement.why
    assert "ranked lower by performance" in placement.rejected["cambricon:0-1"]
    assert "would rank ahead" not in placement.why  # the decode estimate agrees


def _swap(device: dict[str, Any], fields: tuple[str, ...]) -> None:
    figures = {
        "ascend": {"int8_compute_power_tflops": 512, "memory_bandwidth_gbps": 1600},
        "cambricon": {"int8_compute_power_tflops": 256, "memory_bandwidth_gbps": 307.2},
    }
    other = {"ascend": "cambricon", "cambricon": "ascend"}.get(device["device_type"])
    if other is not None:
        for name in fields:
            device[name] = figures[other][name]


def test_swapping_the_pools_int8_figures_swaps_the_placement(edited_config: EditConfig) -> None:
    swapped = edited_config("mixed", lambda d: _swap(d, ("int8_compute_power_tflops",)))
    placement = place(int8_llama(), node("mixed", swapped), LLAMA)
    assert device_types(placement.target_device) == {"cambricon"}
    assert placement.plans[0].compute_tokens_per_s == pytest.approx(
        512e12 / LLAMA.flops_per_token(), rel=1e-3
    )
    assert "performance: int8 compute 512 TOPS" in placement.why
    ascend = placement.rejected["ascend:0-3"]
    assert "ranked lower by performance: " in ascend and "int8 compute 256 TOPS" in ascend
    # w8a8 weights run on one rank: tp > 1 is refused with the reason
    assert "tp=2: the embedded engine runs w8a8 weights on one rank only" in ascend
    # the decode estimate disagrees (1600 vs 307 GB/s), and the reasons say so
    assert "ascend:0-3 would rank ahead under scorer roofline" in placement.why


def test_swapping_tops_and_bandwidth_swaps_both_scorers(edited_config: EditConfig) -> None:
    fields = ("int8_compute_power_tflops", "memory_bandwidth_gbps")
    swapped = node("mixed", edited_config("mixed", lambda d: _swap(d, fields)))
    for scorer in ("performance", "roofline"):
        placement = place(int8_llama(scorer=scorer), swapped, LLAMA)
        assert device_types(placement.target_device) == {"cambricon"}, scorer
        assert f"ranked lower by {scorer}" in placement.rejected["ascend:0-3"]
        assert "would rank ahead" not in placement.why


def test_without_bandwidth_figures_the_int8_tops_alone_decide(edited_config: EditConfig) -> None:
    def tops_only(device: dict[str, Any]) -> None:
        _swap(device, ("int8_compute_power_tflops",))
        device.pop("memory_bandwidth_gbps", None)

    inventory = node("mixed", edited_config("mixed", tops_only))
    for scorer in ("performance", "roofline"):
        placement = place(int8_llama(scorer=scorer), inventory, LLAMA)
        assert device_types(placement.target_device) == {"cambricon"}, scorer


def test_roofline_ranks_by_decode_which_bandwidth_decides(edited_config: EditConfig) -> None:
    """Llama-3-8B decoding reads ~9 GB per step: 1600 GB/s beats 307 GB/s whatever the TOPS."""
    swapped = edited_config("mixed", lambda d: _swap(d, ("int8_compute_power_tflops",)))
    placement = place(int8_llama(scorer="roofline"), node("mixed", swapped), LLAMA)
    assert device_types(placement.target_device) == {"ascend"}
    plan = placement.plans[0]
    assert plan.estimated_tokens_per_s is not None and plan.compute_tokens_per_s is not None
    assert plan.estimated_tokens_per_s < plan.compute_tokens_per_s  # bandwidth-bound
    assert "roofline: decode estimate" in placement.why
    assert "cambricon:0-1 would rank ahead under scorer performance" in placement.why
    assert "ranked lower by roofline" in placement.rejected["cambricon:0-1"]


def test_preferred_device_types_override_the_score() -> None:
    placement = place(
        int8_llama(preferred_device_types=["cambricon", "ascend"]), node("mixed"), LLAMA
    )
    assert device_types(placement.target_device) == {"cambricon"}
    assert "preferred device type cambricon" in placement.why
    assert "preferred_device_types" in placement.rejected["ascend:0-3"]


def test_w8a8_without_int8_is_rejected_naming_the_field_and_the_device(
    edited_config: EditConfig,
) -> None:
    def no_int8(device: dict[str, Any]) -> None:
        if device["device_type"] == "ascend":
            device["supported_dtypes"] = ["fp16", "bf16"]

    inventory = node("mixed", edited_config("mixed", no_int8))
    with pytest.raises(ConfigError) as caught:
        place(int8_llama(device="ascend:0"), inventory, LLAMA)
    message = str(caught.value)
    assert "quantization=w8a8" in message and "ascend:0" in message
    assert "supported_dtypes ['bf16', 'fp16']" in message
    placement = place(int8_llama(), inventory, LLAMA)  # elsewhere, saying why not ascend
    assert "ascend" not in placement.target_device
    assert "quantization=w8a8 needs int8" in placement.rejected["ascend:0-3"]


def test_unknown_device_and_too_long_context_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="'ascend:9' does not exist.*cambricon:1"):
        place(int8_llama(device="ascend:9"), node("mixed"), LLAMA)
    with pytest.raises(ConfigError, match="max_model_len=9000 is above the model's 8192"):
        place(int8_llama(max_model_len=9000), node("mixed"), LLAMA)


def test_replayed_devices_plan_but_do_not_start() -> None:
    with pytest.raises(ConfigError) as caught:
        place(int8_llama(device="ascend:0"), node("mixed"), LLAMA, starting=True)
    assert "torch backend for npu (torch_npu) is not installed here" in str(caught.value)
    # w8a8 is no longer refused by the engine: it starts elsewhere, saying why not the Ascend
    placement = place(int8_llama(), node("mixed"), LLAMA, starting=True)
    assert "ascend" not in placement.target_device and placement.plans[0].quantization == "w8a8"
    assert "torch_npu" in placement.rejected["ascend:0-3"]


# ---- the 8 x Ascend 910A node: topology, Degraded devices ----


def test_tensor_parallel_groups_take_the_nearest_ready_devices() -> None:
    inventory = node("ascend-910a-8x")  # ascend:3 and :7 are Degraded
    pair = place(WorkloadSpec(model="Llama-3-8B", dtype="fp32"), inventory, LLAMA)
    plan = pair.plans[0]
    assert plan.tensor_parallel_size == 2 and len(plan.devices) == 2
    first, second = (int(d.split(":")[1]) for d in plan.devices)
    row = inventory.get(plan.devices[0]).get("topology_distance")  # type: ignore[union-attr]
    assert row[second] == 5 and not {first, second} & {3, 7}
    assert plan.env["ASCEND_RT_VISIBLE_DEVICES"] == f"{first},{second}"
    assert any(r.tp == 1 and "MiB usable" in r.reason for r in pair.alternatives)
    four = place(
        WorkloadSpec(model="Qwen3-8B", dtype="fp32", kv_cache_memory_mb=40000),
        inventory,
        model("Qwen3-8B"),
    )
    # of the Ready devices 0,1,2,4,5,6 only {0,1,4,5} keeps every pair within distance 30
    assert four.plans[0].tensor_parallel_size == 4
    assert sorted(four.plans[0].devices) == ["ascend:0", "ascend:1", "ascend:4", "ascend:5"]


def test_degraded_devices_only_when_nothing_ready_fits() -> None:
    caps = [capacity_of(p) for p in node("ascend-910a-8x").profiles]  # :3 and :7 Degraded
    placer = Placer(caps)
    demand = demand_of(WorkloadSpec(model="Llama-3-8B"), LLAMA)
    held: list[dict[str, Any]] = []
    for _ in range(40):
        placement = placer.place(demand)
        degraded = [c.device_id for g in placement.groups for c in g if c.degraded]
        if degraded:
            break
        held += [r.to_dict() for r in placement.reservations]
    else:
        pytest.fail("the Ready devices never filled up")
    assert set(degraded) <= {"ascend:3", "ascend:7"}
    assert "Degraded, but nothing Ready fits" in placement.why
    first_six = {r["device"] for r in held[:6]}
    assert first_six == {f"ascend:{i}" for i in (0, 1, 2, 4, 5, 6)}  # tp=1 on each Ready one
    ready_only = Placer([c for c in caps if not c.degraded], Ledger.from_reservations(held))
    with pytest.raises(ConfigError, match="every device is taken"):
        ready_only.place(demand)


def test_binpack_fills_one_device_and_spread_uses_all() -> None:
    inventory = node("ascend-910a-8x")
    small = model("Qwen2-0.5B")
    targets: dict[str, set[str]] = {}
    for scorer in ("binpack", "spread"):
        placer = Placer([capacity_of(p) for p in inventory.profiles])
        spec = WorkloadSpec(model="Qwen2-0.5B", scorer=scorer, max_model_len=4096)
        targets[scorer] = {placer.place(demand_of(spec, small)).target_device for _ in range(6)}
    assert len(targets["binpack"]) == 1
    assert targets["spread"] == {f"ascend:{i}" for i in (0, 1, 2, 4, 5, 6)}


# ---- priority shares of KV memory ----


WEIGHTS = {"high": 3, "normal": 2, "low": 1}


def test_sharers_split_kv_memory_3_2_1_by_priority() -> None:
    """Each workload planned with the other two on the device gets its share of the memory
    left after all three's weights (batch 256 at 128k context wants more than any share)."""
    caps = [capacity_of(p) for p in node("mixed").profiles]
    small = model("Qwen2-0.5B")
    specs = {
        p: WorkloadSpec(model="Qwen2-0.5B", device="ascend:0", priority=p, max_num_seqs=256)
        for p in WEIGHTS
    }
    alone = Placer(caps).place(demand_of(specs["high"], small))
    base = alone.reservations[0].to_dict()
    budgets = {}
    for p, spec in specs.items():
        others = [{**base, "priority_weight": WEIGHTS[q]} for q in WEIGHTS if q != p]
        placement = Placer(caps, Ledger.from_reservations(others)).place(demand_of(spec, small))
        budgets[p] = placement.plans[0].kv_cache_memory_mb
        assert "2 other workload(s) share the device" in placement.plans[0].notes[0]
    assert budgets["high"] == pytest.approx(3 * budgets["low"], rel=0.01)
    assert budgets["normal"] == pytest.approx(2 * budgets["low"], rel=0.01)
    left = alone.plans[0].memory["usable_mb"] - 3 * base["weights_mb"]
    assert sum(budgets.values()) == pytest.approx(left, rel=0.01)


def test_a_sharer_that_would_squeeze_others_below_one_sequence_is_refused() -> None:
    """Seven low workloads (1.5 GiB KV minimum each) share an MLU370; a high one would take
    3/10 of the rest and leave each low one less than its minimum; another low one fits."""
    caps = [capacity_of(p) for p in node("mixed").profiles]
    small = model("Qwen2-0.5B")
    low = WorkloadSpec(model="Qwen2-0.5B", device="cambricon:0", priority="low")
    placer = Placer(caps)
    for _ in range(7):
        placer.place(demand_of(low, small))
    high = low.model_copy(update={"priority": "high"})
    with pytest.raises(ConfigError, match="cambricon:0 is taken.*high share"):
        placer.place(demand_of(high, small))
    assert placer.place(demand_of(low, small)).target_device == "cambricon:0"
