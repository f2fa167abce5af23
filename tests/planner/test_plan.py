"""The execution plan's parts: dtype order, KV blocks from memory, operators and their
fallbacks, vendor attributes as engine options, and the visibility environment."""

from __future__ import annotations

import pytest
from tests.planner.conftest import EditConfig, model, node

from kunlun.device.inventory import build_inventory
from kunlun.engine.native import recorded_choice
from kunlun.planner import operators
from kunlun.planner.capacity import capacity_of
from kunlun.planner.engine_options import engine_options
from kunlun.planner.estimate import BLOCK_SIZE
from kunlun.planner.plan import dtype_order
from kunlun.workload.placement import place
from kunlun.workload.spec import WorkloadSpec

QWEN = model("Qwen2-0.5B")


def test_this_cpu_gets_fp32_unless_it_computes_bf16_natively() -> None:
    inventory = build_inventory()  # live discovery: this machine's CPU
    cpu = inventory.get("cpu:0")
    assert cpu is not None
    placement = place(WorkloadSpec(model="Qwen2-0.5B", max_model_len=2048), inventory, QWEN)
    plan = placement.plans[0]
    native = (cpu.get("attributes") or {}).get("bf16_native") == "yes"
    assert plan.devices == ["cpu:0"] and plan.dtype == ("bf16" if native else "fp32")
    assert plan.torch_device == "cpu" and plan.env == {}
    assert plan.fallback_ops == []  # torch's own CPU kernels are the native path
    assert plan.kv_cache_memory_mb <= 1024  # host RAM: KV capped unless the spec sets it
    if not native:
        reasons = [r.reason for r in placement.alternatives if r.dtype == "bf16"]
        assert reasons == ["bf16 has no native units here (bf16_native: no); fp32 is preferred"]


def test_dtype_order_prefers_the_checkpoint_and_native_units() -> None:
    caps = {p.device_type: capacity_of(p) for p in node("mixed").profiles}
    assert dtype_order(QWEN, caps["ascend"]) == ["bf16", "fp16", "fp32"]
    plan = place(WorkloadSpec(model="Qwen2-0.5B", device="nvidia:0"), node("mixed"), QWEN)
    assert plan.dtype == "fp16"  # the T4 has no bf16
    assert "dtype bf16 not in supported_dtypes" in " ".join(r.reason for r in plan.alternatives)


def test_kv_blocks_come_from_the_device_memory_budget() -> None:
    placement = place(
        WorkloadSpec(model="Llama-3-8B", max_num_seqs=64), node("mixed"), model("Llama-3-8B")
    )
    plan = placement.plans[0]
    per_token = model("Llama-3-8B").kv_bytes_per_token(plan.dtype)
    assert plan.num_kv_blocks == plan.kv_cache_memory_mb * (1 << 20) // (BLOCK_SIZE * per_token)
    memory = plan.memory
    assert memory["source"] == "hbm_memory_mb (validated)" and memory["host_memory_mb"] == 1024
    assert memory["host_memory_used"] is False
    # 64 x 8192 tokens want 64 GiB: the budget is what is left after the weights
    left = memory["usable_mb"] - plan.weight_memory_mb
    assert plan.kv_cache_memory_mb == pytest.approx(left, abs=2)
    assert plan.max_num_seqs == 64


def test_the_operator_report_is_what_the_engine_runs_and_names_what_the_chip_offers() -> None:
    """The report comes from the engine's own kernel registry: on an Ascend NPU the engine
    runs torch's ops through torch_npu, and each op the vendor has a fused kernel for is a
    fallback naming that kernel; on this CPU every op is the engine's native kernel."""
    npu = dict(operators.choose_operators("npu", "none"))
    decode = npu.pop("decode")  # torch_npu offers no whole decode step: the reference path
    assert not decode.fallback and decode.implementation.startswith("the model's modules")
    assert {op: c.fallback for op, c in npu.items()} == {
        op: True for op in operators.OPERATORS if op != "decode"
    }
    assert npu["attention"].implementation.startswith("torch.nn.functional.scaled_dot_product")
    assert "npu_fusion_attention (torch_npu) is not wired into it" in npu["attention"].why
    quantized = operators.choose_operators("npu", "w4a16")["matmul"]
    assert quantized.fallback and quantized.implementation.startswith("dequantize")
    on_cpu = operators.choose_operators("cpu", "w4a16")
    assert not any(c.fallback for c in on_cpu.values())
    record = recorded_choice()  # int4 on this CPU: the kernel measured faster, with its figures
    assert record is not None, "make setup builds and measures the compiled library"
    for dtype, activations in (("fp32", "float32"), ("bf16", "bfloat16")):  # each its own
        matmul = operators.choose_operators("cpu", "w4a16", dtype)["matmul"]
        int4 = ("Kunlun's int4 kernel" if "int4_matmul" in record.ops(activations)
                else "torch._weight_int4pack")  # fmt: skip
        assert matmul.implementation.startswith(int4), (dtype, record)
        assert record.describe(activations) in matmul.why
        assert f"{activations} activations: int4_matmul" in matmul.why and "int4pack" in matmul.why
    assert on_cpu["decode"].implementation.startswith("Kunlun's compiled decode step")
    assert "float32 or bfloat16 on one rank" in on_cpu["decode"].implementation
    cuda = operators.choose_operators("cuda", "w8a8")["matmul"]  # NVIDIA offers nothing else
    assert not cuda.fallback and cuda.implementation.startswith("torch._int_mm")
    unknown = operators.choose_operators("xla", "none")["rmsnorm"]
    assert unknown.fallback and "no device plugin registers xla" in unknown.why


def test_the_quantized_layers_run_the_kernel_the_plan_reports() -> None:
    """One registry: a QuantLinear on this CPU picks the kernel the report names."""
    import torch

    from kunlun.engine.models.quant_linear import QuantLinear
    from kunlun.engine.quant import QuantSpec

    CPU = torch.device("cpu")
    record = recorded_choice()
    assert record is not None, "make setup builds and measures the compiled library"
    int4 = "int4" if "int4_matmul" in record.ops("float32") else "int4pack"
    for scheme, key in (("w8a16", "int8pack"), ("w8a8", "int8pack"), ("w4a16", int4)):
        spec = QuantSpec(scheme, 32 if scheme == "w4a16" else None)
        layer = QuantLinear(64, 32, spec, bias=False, dtype=torch.float32, device=CPU)
        for tensor in layer.canonical().values():  # as if loaded (empty memory may hold NaN)
            tensor.zero_()
        layer.prepare(record.ops("float32"))
        assert layer.kernel == key
        reported = operators.choose_operators("cpu", scheme)["matmul"].implementation
        assert reported.startswith({"int8pack": "torch._weight_int8pack_mm", "int4":
                                    "Kunlun's int4 kernel", "int4pack":
                                    "torch._weight_int4pack_mm_for_cpu"}[key])  # fmt: skip


def test_vendor_attributes_become_engine_options_and_environment() -> None:
    options, env, notes = engine_options(
        {"hipblaslt_enabled": True, "num_threads": 4, "mystery": 1}
    )
    assert options == {"hipblaslt": True, "num_threads": 4}
    assert env == {"TORCH_BLAS_PREFER_HIPBLASLT": "1"}
    assert any("mystery" in n and "not used" in n for n in notes)
    plan = place(WorkloadSpec(model="Qwen2-0.5B"), node("mixed"), QWEN).plans[0]
    assert plan.engine_options == {"operator_fusion": True}  # aclnn_fusion_enabled
    amd = node("amd-rx7800xt")
    amd_plan = place(WorkloadSpec(model="Qwen2-0.5B"), amd, QWEN).plans[0]
    assert amd_plan.env["TORCH_BLAS_PREFER_HIPBLASLT"] == "0"  # hipblaslt_enabled: false
    assert amd_plan.env["HIP_VISIBLE_DEVICES"] == "0"


def test_memory_split_fields_feed_the_budget(edited_config: EditConfig) -> None:
    def smaller_hbm(device: dict[str, object]) -> None:
        if device["device_type"] == "ascend":
            device["hbm_memory_mb"] = 16384

    plan = place(
        WorkloadSpec(model="Qwen2-0.5B", preferred_device_types=["ascend"]),
        node("mixed", edited_config("mixed", smaller_hbm)),
        QWEN,
    ).plans[0]
    assert plan.memory["device_memory_mb"] == 16384
    assert plan.memory["source"] == "hbm_memory_mb (validated)"
