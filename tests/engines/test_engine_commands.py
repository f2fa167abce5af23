"""Golden command lines of the external engines, from real plans on recorded nodes.

Each plan is made by the planner from a node replayed from recorded vendor-tool output
(``examples/nodes``) and the shipped Qwen2-0.5B configuration; the adapter turns it into the
exact argv and environment the engine is started with. Nothing is launched.

Flag names written from (read for this table, December 2026):
- vLLM engine arguments (docs.vllm.ai, "Engine Arguments", v0.11) and the vllm-ascend user
  guide (docs.vllm.ai/projects/ascend, v0.11.0: environment variables, quick start);
- SGLang "Server Arguments" (docs.sglang.io/advanced_features/server_arguments) and "Support
  Features on Ascend NPU" (docs.sglang.io/platforms/ascend_npu_support_features: --device
  npu, --attention-backend ascend, --dtype float16/bfloat16);
- llama.cpp ``tools/server/README.md`` (llama-server: --ctx-size shared by --parallel
  slots, --cont-batching, --n-gpu-layers, --cache-type-k/v, --metrics, --alias).
The Cambricon rows (vllm-mlu, SGLang with --device mlu) and the Hygon DTK rows follow the
vendor builds' naming; no vendor document was available to check them against.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from tests.planner.conftest import model, node

from kunlun.device.inventory import build_inventory
from kunlun.engines.adapter import LaunchContext
from kunlun.engines.builtin import KunlunEngine, LlamaCppEngine, SglangEngine, VllmEngine
from kunlun.errors import ConfigError
from kunlun.planner.plan import ENGINE_DTYPES, ExecutionPlan
from kunlun.workload.placement import place
from kunlun.workload.spec import WorkloadSpec

QWEN = model("Qwen2-0.5B")
CONTEXT = LaunchContext(Path("/models/Qwen2-0.5B"), "qwen", 8100, Path("/logs/wl-1.log"))
GGUF = LaunchContext(Path("/models/qwen2-0_5b-q4_1.gguf"), "qwen", 8100, Path("/logs/wl-1.log"),
                     num_threads=4)  # fmt: skip


def plan_on(name: str, device: str | None = None, **spec: object) -> ExecutionPlan:
    fields = {"max_model_len": 4096, "max_num_seqs": 32, **spec}
    return place(WorkloadSpec(model="Qwen2-0.5B", device=device, **fields), node(name),  # type: ignore[arg-type]
                 QWEN).plans[0]  # fmt: skip


def common(engine: str) -> list[str]:
    if engine == "vllm":
        return ["python", "-m", "vllm.entrypoints.openai.api_server",
                "--model", "/models/Qwen2-0.5B", "--served-model-name", "qwen",
                "--host", "127.0.0.1", "--port", "8100"]  # fmt: skip
    return ["python", "-m", "sglang.launch_server", "--model-path", "/models/Qwen2-0.5B",
            "--served-model-name", "qwen", "--host", "127.0.0.1", "--port", "8100"]  # fmt: skip


def vllm_tail(tp: int, dtype: str, step: int) -> list[str]:
    return ["--tensor-parallel-size", str(tp), "--dtype", dtype, "--max-model-len", "4096",
            "--max-num-seqs", "32", "--max-num-batched-tokens", str(step),
            "--gpu-memory-utilization", "0.9"]  # fmt: skip


def sglang_tail(tp: int, dtype: str, step: int, device: str, *backend: str) -> list[str]:
    return ["--tp-size", str(tp), "--dtype", dtype, "--context-length", "4096",
            "--max-running-requests", "32", "--chunked-prefill-size", str(step),
            "--mem-fraction-static", "0.9", "--device", device,
            *(["--attention-backend", backend[0]] if backend else []),
            "--enable-metrics"]  # fmt: skip


# (node, device, spec fields) -> plan; the plan's dtype and step budget are the planner's
FAMILIES = {
    "nvidia": ("mixed", "nvidia:0", {}),  # the T4: fp16 (no bf16)
    "amd": ("amd-rx7800xt", None, {}),
    "ascend": ("ascend-910a-8x", None, {"tensor_parallel_size": 2}),
    "cambricon": ("mixed", "cambricon:0", {}),
    "hygon": ("hygon-dcu", None, {}),
}
GOLDEN = {
    "nvidia": (
        vllm_tail(1, "float16", 3280),
        sglang_tail(1, "float16", 3280, "cuda"),
        {"CUDA_VISIBLE_DEVICES": "0"},
        {},
    ),
    "amd": (
        vllm_tail(1, "bfloat16", 3760),
        sglang_tail(1, "bfloat16", 3760, "cuda", "triton"),
        {"HIP_VISIBLE_DEVICES": "0", "TORCH_BLAS_PREFER_HIPBLASLT": "0"},
        {},
    ),
    "ascend": (
        vllm_tail(2, "float16", 8192),
        sglang_tail(2, "float16", 8192, "npu", "ascend"),
        {"ASCEND_RT_VISIBLE_DEVICES": "5,6"},
        {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
    ),
    "cambricon": (
        vllm_tail(1, "bfloat16", 4848),
        sglang_tail(1, "bfloat16", 4848, "mlu"),
        {"MLU_VISIBLE_DEVICES": "0"},
        {},
    ),
    "hygon": (
        vllm_tail(1, "bfloat16", 8192),
        sglang_tail(1, "bfloat16", 8192, "cuda", "triton"),
        {"HIP_VISIBLE_DEVICES": "0", "TORCH_BLAS_PREFER_HIPBLASLT": "1"},
        {},
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_and_sglang_commands_per_vendor_family(family: str) -> None:
    name, device, spec = FAMILIES[family]
    plan = plan_on(name, device, **spec)
    assert plan.device_type == family
    vllm_argv, sglang_argv, env, vllm_env = GOLDEN[family]
    vllm = VllmEngine().command(plan, CONTEXT)
    assert vllm.argv == common("vllm") + vllm_argv
    assert vllm.env == {**env, **vllm_env}
    sglang = SglangEngine().command(plan, CONTEXT)
    assert sglang.argv == common("sglang") + sglang_argv
    assert sglang.env == env
    for command in (vllm, sglang):
        assert (command.host, command.port) == ("127.0.0.1", 8100)
        assert (command.ready_path, command.metrics_path) == ("/health", "/metrics")
        assert command.log_file == Path("/logs/wl-1.log")
        assert (command.stop_signal, command.stop_grace_s) == (signal.SIGTERM, 30.0)


def test_llama_server_on_nvidia_offloads_every_layer() -> None:
    plan = plan_on("mixed", "nvidia:0", max_num_batched_tokens=512)
    command = LlamaCppEngine().command(plan, GGUF)
    assert command.argv == [
        "llama-server", "--model", "/models/qwen2-0_5b-q4_1.gguf", "--alias", "qwen",
        "--host", "127.0.0.1", "--port", "8100", "--ctx-size", str(4096 * 32),
        "--parallel", "32", "--threads-http", "34", "--cont-batching", "--n-gpu-layers", "999", "--threads", "4",
        "--batch-size", "512", "--cache-type-k", "f16", "--cache-type-v", "f16", "--metrics",
    ]  # fmt: skip
    assert command.env == {"CUDA_VISIBLE_DEVICES": "0"}


def test_llama_server_on_this_cpu() -> None:
    spec = WorkloadSpec(model="Qwen2-0.5B", device="cpu:0", dtype="fp32", max_model_len=2048,
                        max_num_seqs=4, max_num_batched_tokens=256)  # fmt: skip
    plan = place(spec, build_inventory(), QWEN).plans[0]  # live discovery: this machine
    command = LlamaCppEngine().command(plan, GGUF)
    # as many slots of 2,048 tokens as the plan's KV holds, at most its 4 sequences
    slots = max(1, min(4, plan.num_kv_blocks * plan.block_size // 2048))
    assert command.argv == [
        "llama-server", "--model", "/models/qwen2-0_5b-q4_1.gguf", "--alias", "qwen",
        "--host", "127.0.0.1", "--port", "8100", "--ctx-size", str(2048 * slots),
        "--parallel", str(slots), "--threads-http", "6", "--cont-batching", "--n-gpu-layers", "0", "--threads", "4", "--batch-size", "256",
        "--cache-type-k", "f32", "--cache-type-v", "f32", "--metrics",
    ]  # fmt: skip
    assert command.env == {}


# ---- what an engine cannot express is refused by name ----


def test_a_quantization_vllm_does_not_take_is_refused() -> None:
    plan = plan_on("mixed", "nvidia:0", quantization="w8a8")
    with pytest.raises(ConfigError) as err:
        VllmEngine().command(plan, CONTEXT)
    assert "engine vllm cannot run quantization='w8a8'" in err.value.message
    assert err.value.location is not None and err.value.location.path == "quantization"


def test_llama_cpp_cannot_split_a_model_on_a_cpu() -> None:
    spec = WorkloadSpec(model="Qwen2-0.5B", device="cpu:0", dtype="fp32", max_model_len=2048,
                        max_num_seqs=4, tensor_parallel_size=2)  # fmt: skip
    plan = place(spec, build_inventory(), QWEN).plans[0]
    with pytest.raises(ConfigError) as err:
        LlamaCppEngine().command(plan, GGUF)
    assert "engine llama.cpp cannot run tensor_parallel_size=2" in err.value.message


def test_sglang_on_ascend_does_not_compute_in_fp32() -> None:
    plan = plan_on("ascend-910a-8x", None, dtype="fp32", tensor_parallel_size=2)
    with pytest.raises(ConfigError) as err:
        SglangEngine().command(plan, CONTEXT)
    assert "engine sglang cannot run dtype='fp32'" in err.value.message
    assert "bf16, fp16" in err.value.message


def test_an_engine_without_a_row_for_the_device_type_is_refused() -> None:
    with pytest.raises(ConfigError, match="engine llama.cpp cannot run device_type='ascend'"):
        LlamaCppEngine().command(plan_on("ascend-910a-8x", None, tensor_parallel_size=2), GGUF)


def test_every_engine_spells_every_plan_dtype() -> None:
    for adapter in (VllmEngine(), SglangEngine(), LlamaCppEngine()):
        assert set(adapter.dtype_flags) == set(ENGINE_DTYPES), adapter.name


def test_the_embedded_engine_is_the_worker_launch() -> None:
    from kunlun.engine.launch import worker_command

    plan = plan_on("mixed", "nvidia:0")
    context = LaunchContext(CONTEXT.model_path, "qwen", 8100, Path("/logs/wl-1.log"),
                            launch_file=Path("/run/w1/launch.json"))  # fmt: skip
    command = KunlunEngine().command(plan, context)
    assert command.argv == worker_command("/run/w1/launch.json")
    assert command.env == plan.env and command.ready_path is None
    with pytest.raises(ConfigError, match="launch_file"):
        KunlunEngine().command(plan, CONTEXT)


def test_a_seeded_request_is_prefilled_whole_on_llama_cpp() -> None:
    """llama-server reuses a cached prompt's KV, computed in another batch shape; in bf16 the
    sampled answer then changes with the cache, so a seeded request turns the reuse off."""
    from kunlun.engines.registry import engine_named

    engine = engine_named("llama.cpp")
    seeded = engine.request_body("/v1/completions", {"model": "m", "prompt": "hi", "seed": 3})
    assert seeded["cache_prompt"] is False and seeded["seed"] == 3
    plain = engine.request_body("/v1/completions", {"model": "m", "prompt": "hi", "seed": None})
    assert "cache_prompt" not in plain
