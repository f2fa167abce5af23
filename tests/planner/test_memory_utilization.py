"""A workload's ``memory_utilization`` (vLLM's ``--gpu-memory-utilization``): the fraction of
each device's memory its plans may use, through the fit check, the KV budget, the plan and
the plan cache key; on a host CPU an explicit fraction replaces the default KV cap."""

from __future__ import annotations

import pytest
from tests.planner.conftest import model, node

from kunlun.device.inventory import build_inventory
from kunlun.errors import ConfigError
from kunlun.planner.cache import device_snapshot, key_inputs
from kunlun.planner.capacity import MEMORY_UTILIZATION, capacity_of, usable_memory_mb
from kunlun.planner.estimate import memory_need
from kunlun.planner.plan import HOST_KV_CAP_MB, ExecutionPlan
from kunlun.workload.placement import Placer, demand_of, place
from kunlun.workload.spec import WorkloadSpec, parse_spec

LLAMA = model("Llama-3-8B")


def plan_on(device: str, fraction: float | None) -> ExecutionPlan:
    """The plan of Llama-3-8B on ``device`` of the mixed node, with 64 sequences (their KV
    wants far more than fits: the budget is all the memory left after the weights)."""
    spec = parse_spec({"model": "Llama-3-8B", "device": device, "max_num_seqs": 64,
                       "memory_utilization": fraction})  # fmt: skip
    return place(spec, node("mixed"), LLAMA).plans[0]


def test_the_fraction_sizes_the_kv_budget_after_the_weights() -> None:
    profile = node("mixed").get("ascend:0")
    assert profile is not None
    total, used = float(profile.get("memory_total_mb")), float(profile.get("memory_used_mb"))
    plans = {}
    for fraction in (None, 0.5):
        plan = plan_on("ascend:0", fraction)
        usable = total * (fraction or MEMORY_UTILIZATION) - used
        assert plan.memory["usable_mb"] == round(usable)
        assert plan.memory["utilization"] == (fraction or MEMORY_UTILIZATION)
        assert plan.kv_cache_memory_mb == pytest.approx(usable - plan.weight_memory_mb, abs=2)
        assert plan.memory_utilization == fraction
        plans[fraction] = plan
    default, half = plans[None], plans[0.5]
    assert default.kv_cache_memory_mb - half.kv_cache_memory_mb == pytest.approx(
        total * (MEMORY_UTILIZATION - 0.5), abs=2
    )
    assert half.num_kv_blocks < default.num_kv_blocks
    assert "memory_utilization 0.5" in half.summary()
    assert any("memory_utilization 0.5" in note for note in half.notes)
    assert "memory_utilization" not in default.summary()


def test_a_different_fraction_is_a_different_plan_cache_key() -> None:
    snapshots = [device_snapshot(capacity_of(node("mixed").profiles[0]))]
    keys = [key_inputs("fingerprint", snapshots, plan_on("ascend:0", f))
            for f in (None, 0.5, 0.6)]  # fmt: skip
    assert "memory_utilization" not in keys[0]["plan"]  # the default keeps the old keys
    assert keys[1]["plan"]["memory_utilization"] == 0.5
    assert len({repr(k) for k in keys}) == 3


def test_a_fraction_too_small_for_the_weights_is_refused_with_the_memory() -> None:
    # 8B in fp16 is about 15 GiB: 20% of the 16 GiB T4 holds none of it
    with pytest.raises(ConfigError) as caught:
        plan_on("nvidia:0", 0.2)
    message = str(caught.value)
    assert f"{usable_memory_mb(15360, 0, 0.2):.0f} MiB usable (memory_utilization 0.2)" in message


@pytest.mark.parametrize("value", [0, -0.1, 1.01, "most"])
def test_an_out_of_range_fraction_is_an_error_naming_the_field(value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_spec({"model": "Llama-3-8B", "memory_utilization": value}, "spec.yaml")
    assert caught.value.location is not None
    assert caught.value.location.field == "memory_utilization"
    assert "memory_utilization" in str(caught.value)


def test_vllms_name_is_accepted_in_a_spec_file() -> None:
    spec = parse_spec({"model": "Llama-3-8B", "gpu_memory_utilization": 0.7})
    assert spec.memory_utilization == 0.7
    assert spec.model_dump(exclude_unset=True) == {"model": "Llama-3-8B", "memory_utilization": 0.7}


def test_a_placer_refuses_a_demand_of_another_fraction() -> None:
    placer = Placer([capacity_of(p) for p in node("mixed").profiles])
    demand = demand_of(WorkloadSpec.model_validate({"model": "x", "memory_utilization": 0.5}),
                       LLAMA)  # fmt: skip
    with pytest.raises(ValueError, match="memory utilization"):
        placer.place(demand)


def test_on_a_host_cpu_an_explicit_fraction_lifts_the_default_kv_cap() -> None:
    qwen = model("Qwen2-0.5B")
    inventory = build_inventory()  # live discovery: this machine's CPU
    # float32, whose KV for the batch is over the cap (in bf16, on a CPU with native bf16, the
    # batch wants less KV than the cap: there is nothing to lift)
    fields = {"model": "Qwen2-0.5B", "device": "cpu:0", "max_model_len": 4096, "dtype": "fp32"}
    default = place(parse_spec(fields), inventory, qwen).plans[0]
    assert default.kv_cache_memory_mb <= HOST_KV_CAP_MB
    lifted = place(parse_spec({**fields, "memory_utilization": 0.9}), inventory, qwen).plans[0]
    need = memory_need(qwen, lifted.dtype, "none", 1, 4096, None)
    # the fraction of RAM left after weights, up to what the batch can use
    room = lifted.memory["usable_mb"] - lifted.weight_memory_mb
    assert lifted.kv_cache_memory_mb == pytest.approx(
        max(min(room, need.wanted_kv_mb), need.min_kv_mb), abs=2
    )
    if min(room, need.wanted_kv_mb) > HOST_KV_CAP_MB + 2:
        assert lifted.kv_cache_memory_mb > HOST_KV_CAP_MB
